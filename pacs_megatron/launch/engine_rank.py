"""An engine rank of ``rollout.placement=separate``: ``python -m pacs_megatron.launch.engine_rank``.

Started beside the trainer ranks by the launcher (launch/local.py, launch/ray_launcher.py; under torchrun or
srun by trainer rank 0, :func:`spawn_engines`), with the trainer job's store in ``PACS_ROLLOUT_STORE`` and
its index in ``PACS_ENGINE_INDEX``. It needs no config of its own: trainer rank 0 sends the resolved one
(rollout/remote/protocol.py). Then it builds its engine (HF or vLLM; GPU ``cuda:0`` of its CUDA_VISIBLE_DEVICES,
else CPU with OMP_NUM_THREADS threads), joins the weight group (weight_sync/remote.py) and serves the
trainer (rollout/remote/server.py) until told to close.

An engine is no trainer rank: RANK / WORLD_SIZE / MASTER_* are dropped from its environment (vLLM's external
launcher in it is a world of one), and it leaves the stop signals to the trainer, which checkpoints and
then closes it (utils/proc.helper_process); it dies with the process that started it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from pacs_megatron.rollout.remote.protocol import INDEX_ENV, STORE_ENV, TIMEOUT_ENV
from pacs_megatron.utils.logging import get_logger, init_logging
from pacs_megatron.utils.proc import die_with_parent, helper_process, run_main

logger = get_logger(__name__)

MODULE = "pacs_megatron.launch.engine_rank"
STARTED_ENV = "PACS_ENGINES_STARTED"
"""Set in the trainer ranks by a launcher that started the engines; without it trainer rank 0 starts them."""
TRAINER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def engine_env(
    base: dict[str, str], index: int, store: str, threads: int, timeout_s: float, gpu: str | None = None
) -> dict[str, str]:
    """The environment of engine ``index``: ``base`` without the trainer-rank variables, plus its own."""
    env = {k: v for k, v in base.items() if k not in TRAINER_ENV and not k.startswith("TORCHELASTIC_")}
    env |= {
        STORE_ENV: store,
        INDEX_ENV: str(index),
        TIMEOUT_ENV: str(timeout_s),
        "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", str(threads)),
    }
    if gpu is not None:  # GPU launch, never run
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def spawn_engines(cfg, store: str, first_gpu: int | None, threads: int) -> list[subprocess.Popen]:
    """Start ``rollout.engines`` engine processes on this node (children that die with this process); engine e
    gets GPU ``first_gpu + e`` on a GPU node (written for GPU, never run)."""
    procs = []
    for e in range(cfg.rollout.engines):
        gpu = None if first_gpu is None else str(first_gpu + e)
        env = engine_env(dict(os.environ), e, store, threads, cfg.rollout.engine_timeout_s, gpu)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", MODULE], env=env, start_new_session=True, preexec_fn=die_with_parent
            )
        )
    logger.info("started %d rollout engine process(es) (pids %s)", len(procs), [p.pid for p in procs])
    return procs


def engines_for_rank(cfg) -> list[subprocess.Popen]:
    """Under torchrun / srun (no launcher of ours started the engines): trainer rank 0 starts them on its node,
    after its node's trainer ranks' GPUs; every other rank starts none."""
    if cfg.rollout.placement != "separate" or os.environ.get(STARTED_ENV) or os.environ.get("RANK", "0") != "0":
        return []
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = max(1, (os.cpu_count() or 1) // (local + cfg.rollout.engines))
    store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return spawn_engines(cfg, store, local if torch.cuda.is_available() else None, threads)


def serve() -> int:
    """Connect, build the engine, join the weight group, serve; the exit code."""
    import torch

    from pacs_megatron.config import config_from_dict
    from pacs_megatron.data import load_tokenizer
    from pacs_megatron.loop.build import build_rollout_engine, prompt_records, with_run_tools
    from pacs_megatron.rollout.remote.protocol import Failed, Ready, connect_store, engine_listen, recv, send
    from pacs_megatron.rollout.remote.server import EngineServer
    from pacs_megatron.weight_sync.quantize import vllm_fp8_config
    from pacs_megatron.weight_sync.remote import WeightGroup, receive_buckets

    for k in TRAINER_ENV:
        os.environ.pop(k, None)
    index = int(os.environ[INDEX_ENV])
    timeout_s = float(os.environ.get(TIMEOUT_ENV, "900"))
    store = connect_store(timeout_s)
    conn = engine_listen(store, index).accept()
    init = recv(conn)
    try:
        cfg = config_from_dict(init.config)
        device = torch.device("cuda", 0) if init.backend == "nccl" else torch.device("cpu")
        tokenizer = load_tokenizer(init.tokenizer_dir, cfg.data.chat_template)
        context: AbstractContextManager[Any] = nullcontext()
        if cfg.rollout.engine == "vllm":
            from pacs_megatron.rollout.vllm.engine import single_rank_launcher_env

            context = single_rank_launcher_env()  # vLLM's own world of one, for the engine's lifetime
        with context:
            # FP8 rollouts on vLLM: built for the FP8 data + scales the trainer sends (RemoteEngines.traits())
            engine = build_rollout_engine(cfg, init.model_dir, tokenizer, device, vllm_fp8_config(cfg.rollout))
            send(conn, Ready(engine=index, device=str(device)))
            group = WeightGroup(init.backend, store, 1 + index, 1 + init.engines, device, timeout_s)
            receive = lambda msg: receive_buckets(group, msg.layout)  # noqa: E731
            # the turn loop runs here too
            engine = with_run_tools(engine, cfg, tokenizer, prompt_records(cfg, tokenizer))
            code = EngineServer(index, engine, conn, receive, verify=cfg.sync.verify_bitwise).serve()
            engine.close()
        return code
    except Exception as e:  # noqa: BLE001 - before serving: the trainer reports it, naming this engine
        send(conn, Failed(engine=index, error=f"{type(e).__name__}: {e}"))
        raise


def main() -> int:
    helper_process()  # the trainer answers stop signals and closes us; die with our starter
    init_logging()
    try:
        return serve()
    except Exception as e:  # noqa: BLE001 - one line, as the trainer ranks do
        logger.error("engine %s failed: %s", os.environ.get(INDEX_ENV, "?"), e, exc_info=True)
        return 1


if __name__ == "__main__":
    run_main(main)  # no interpreter teardown; multiprocessing's exit (vLLM's children) still runs
