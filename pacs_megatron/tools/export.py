"""``pacs-megatron export CHECKPOINT_DIR OUT_DIR``: a training checkpoint as a Hugging Face model.

    pacs-megatron export outputs/cpu_tiny/checkpoints/step_00000200 outputs/cpu_tiny/hf [--tp 1 --pp 1]

Writes ``OUT_DIR/config.json``, ``model*.safetensors`` and the tokenizer files, loadable by
transformers (``AutoModelForCausalLM.from_pretrained``) and by ``pacs-megatron eval --model``.

Design: the checkpoint is validated first (utils/checkpoint_check.py), and the model directory and
shape it was trained with are read from its ``extra_state.json`` (``--model-dir`` overrides, and must
hold the same shape). Only the model is built and loaded (no DDP buffers, no optimizer: an export
needs a third of the memory of training) through megatron's dist_checkpointing, which reshards, so
any ``--tp/--pp`` loads any checkpoint; by default the checkpoint's own TP x PP, so what fit in
training fits here. Started by hand it spawns ``tp * pp`` local ranks itself (launch/local.py ``on_ranks``);
under torchrun it uses the ranks it finds. The weights are written by ``actor/weights.save_hf``, the
same code as ``trainer.export_hf``, so both give the same files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pacs_megatron.launch.local import on_ranks
from pacs_megatron.utils.checkpoint import MARKER
from pacs_megatron.utils.checkpoint_check import MEGATRON_DIR, checkpoint_problem, parameter_dtype, read_extra_state
from pacs_megatron.utils.checkpoint_data import TRUST, load_common
from pacs_megatron.utils.logging import get_logger, init_logging

logger = get_logger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "Trust: every pickle in the checkpoint is checked to hold data only (code is refused, nothing runs), "
        "then megatron loads it with pickle (weights_only=False), which a file changed in between escapes: "
        f"{TRUST}."
    )
    p.add_argument("checkpoint", help="a checkpoint directory (OUTPUT_DIR/checkpoints/step_XXXXXXXX)")
    p.add_argument("out", help="output Hugging Face model directory")
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel size to load at (default: the checkpoint's)")
    p.add_argument("--pp", type=int, default=0, help="pipeline-parallel size to load at (default: the checkpoint's)")
    p.add_argument("--model-dir", default=None, help="HF config + tokenizer directory (default: the run's model.path)")
    p.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="saved dtype (auto: as trained)"
    )


def _plan(args: argparse.Namespace) -> tuple[str, str, int, int]:
    """(model dir, tokenizer dir, tp, pp) for this checkpoint; ValueError with the fix."""
    from pacs_megatron.utils.resume import check_model_unchanged

    ckpt = Path(args.checkpoint)
    if not (ckpt / MARKER).is_file():
        raise ValueError(f"{ckpt} is not a complete checkpoint (no {MARKER} marker): give a step_XXXXXXXX directory")
    problem = checkpoint_problem(ckpt)
    if problem:
        raise ValueError(f"{ckpt} is damaged: {problem}; export an older checkpoint")
    extra = read_extra_state(ckpt)
    model_cfg = extra.get("config", {}).get("model", {})
    model_dir = args.model_dir or model_cfg.get("path")
    if not model_dir or not (Path(model_dir) / "config.json").is_file():
        raise ValueError(
            f"no HF config for {ckpt}: the run's model.path ({model_dir!r}) has no config.json; pass --model-dir"
        )
    check_model_unchanged(extra.get("model"), json.loads((Path(model_dir) / "config.json").read_text()), ckpt)
    tokenizer_dir = model_cfg.get("tokenizer") if not args.model_dir else ""
    layout = load_common(ckpt / MEGATRON_DIR).get("layout", {})
    return model_dir, tokenizer_dir or model_dir, args.tp or layout.get("tp", 1), args.pp or layout.get("pp", 1)


def run(args: argparse.Namespace, model_dir: str, tokenizer_dir: str, tp: int, pp: int) -> int:
    """One rank's work: build the model chunks, load their weights, write the HF files (collective)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    from pacs_megatron.actor.actor import _seed_for_init, resolve_dtype
    from pacs_megatron.actor.model import build_model_chunks, model_spec_from_hf, transformer_config
    from pacs_megatron.actor.weights import save_hf
    from pacs_megatron.config import ParallelConfig
    from pacs_megatron.parallel import destroy_parallel, init_distributed, initialize_parallel

    ckpt = Path(args.checkpoint)
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    init_distributed(ParallelConfig(tp=tp, pp=pp))
    par = ParallelConfig(tp=tp, pp=pp, dp=max(1, dist.get_world_size() // (tp * pp)))
    groups = initialize_parallel(par, hf, training=False)  # model only: no training forward
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
        spec = model_spec_from_hf(hf_config, tp)
        on_gpu = groups.device.type == "cuda"
        dtype = parameter_dtype(ckpt)
        config = transformer_config(spec, groups, dtype, sequence_parallel=False, recompute=False)
        with torch.random.fork_rng(devices=[groups.device] if on_gpu else []):
            _seed_for_init(0, on_gpu)  # the weights are overwritten by the load
            chunks = build_model_chunks(spec, config, groups)
        keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
        sharded = {k: c.sharded_state_dict() for k, c in zip(keys, chunks)}
        loaded = dist_checkpointing.load(sharded, str(ckpt / MEGATRON_DIR))  # model only: optimizer state stays
        for k, c in zip(keys, chunks):
            c.load_state_dict(loaded[k])
        out_dtype = None if args.dtype == "auto" else resolve_dtype(args.dtype, on_gpu)
        save_hf(chunks, spec, groups, hf_config, args.out, tokenizer_dir, out_dtype)
        if groups.rank == 0:
            logger.info("exported %s (loaded at tp=%d pp=%d) to %s", ckpt, tp, pp, args.out)
        return 0
    finally:
        destroy_parallel()


def main(args: argparse.Namespace) -> int:
    init_logging()
    try:
        model_dir, tokenizer_dir, tp, pp = _plan(args)
    except ValueError as e:
        logger.error("export: %s", e)
        return 2
    argv = ["pacs_megatron", "export", args.checkpoint, args.out, "--tp", str(tp), "--pp", str(pp)]
    argv += ["--dtype", args.dtype] + (["--model-dir", args.model_dir] if args.model_dir else [])
    return on_ranks(argv, tp * pp, lambda: run(args, model_dir, tokenizer_dir, tp, pp))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pacs_megatron.tools.export")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
