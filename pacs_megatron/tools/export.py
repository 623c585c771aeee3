"""``pacs-megatron export CHECKPOINT_DIR OUT_DIR``: a training checkpoint as a Hugging Face model.

    pacs-megatron export outputs/cpu_tiny/checkpoints/step_00000200 outputs/cpu_tiny/hf [--tp 1 --pp 1]

Writes ``config.json``, ``model*.safetensors`` and the tokenizer files; a LoRA run writes a PEFT adapter for
its base (actor/lora/export.py), or with ``--merge`` a whole model. Every argument is checked before any rank
starts (one line, exit 2). Only the model is built, through dist_checkpointing, which reshards: any
``--tp/--pp`` loads any checkpoint (by default its own layout). The weights are written by
``actor/weights.save_hf``, as ``trainer.export_hf`` does. Design: docs/runs.md, "Export".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pacs_megatron.config import ConfigError
from pacs_megatron.launch.local import on_ranks
from pacs_megatron.launch.model_dir import check_model_dir
from pacs_megatron.run.checkpoint import MARKER
from pacs_megatron.run.checkpoint_base import WEIGHT_INITS, export_base_problem
from pacs_megatron.run.checkpoint_check import MEGATRON_DIR, checkpoint_problem, parameter_dtype, read_extra_state
from pacs_megatron.run.checkpoint_data import TRUST, load_common
from pacs_megatron.run.layout import RunLayout, StepLayout
from pacs_megatron.utils.logging import get_logger, init_logging
from pacs_megatron.utils.paths import check_writable_dir

logger = get_logger(__name__)

RECORD = "pacs_export.json"
"""Written into OUT_DIR by each export: which run and checkpoint it holds (a re-export of the same run may
replace it without ``--overwrite``)."""
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.pt", "*.pth")
"""Weight files of a Hugging Face directory, removed from OUT_DIR before an export writes its own."""


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
    p.add_argument(
        "--overwrite", action="store_true", help="write into a non-empty OUT_DIR that is not an export of this run"
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="LoRA runs: a whole HF model with the adapters merged (default: a PEFT adapter for the base model)",
    )


def _run_dir(ckpt: Path) -> str:
    """The run a checkpoint belongs to (OUTPUT_DIR of OUTPUT_DIR/checkpoints/step_N), resolved."""
    return str(ckpt.resolve().parent.parent)


def check_out_dir(out: Path, ckpt: Path, overwrite: bool) -> None:
    """OUT_DIR is absent, empty, an earlier export of this checkpoint's run, or ``--overwrite`` was given;
    otherwise ConfigError naming what it holds and ``--overwrite``."""
    if not out.is_dir() or overwrite:
        return
    held = sorted(p.name for p in out.iterdir())
    if not held:
        return
    try:
        earlier = json.loads((out / RECORD).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        earlier = None
    if earlier == _run_dir(ckpt):
        return
    listing = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    what = f"an export of another run ({earlier})" if earlier else f"not an export of this run (it holds {listing})"
    raise ConfigError(
        f"OUT_DIR {out} is not empty and is {what}: choose a new directory, or pass --overwrite to replace its model"
    )


def clear_weights(out: Path) -> list[str]:
    """Remove the weight files of whatever model OUT_DIR held (the export then writes its own); their names."""
    gone = sorted({p for pattern in WEIGHT_PATTERNS for p in out.glob(pattern) if p.is_file()})
    for p in gone:
        p.unlink()
    return [p.name for p in gone]


def _checkpoint_dir(path: str) -> Path:
    """CHECKPOINT_DIR as given: a complete, undamaged step directory, or ConfigError with the fix."""
    ckpt = Path(path)
    run = RunLayout(ckpt)
    if run.checkpoints.is_dir():  # a run's output dir: name its newest checkpoint
        steps = run.checkpoint_steps()
        example = steps[-1][1].path if steps else run.step_example
        raise ConfigError(f"CHECKPOINT_DIR {ckpt} is a run's output dir: give one of its checkpoints, e.g. {example}")
    if not ckpt.is_dir():
        what = "is a file" if ckpt.exists() else "does not exist"
        raise ConfigError(f"CHECKPOINT_DIR {ckpt} {what}: give a checkpoint directory (OUTPUT_DIR/checkpoints/step_N)")
    if not StepLayout(ckpt).is_complete():
        raise ConfigError(
            f"CHECKPOINT_DIR {ckpt} is not a complete checkpoint (no {MARKER} marker; one being written or left by "
            "a crash): give a step_XXXXXXXX directory that holds it"
        )
    problem = checkpoint_problem(ckpt)
    if problem:
        raise ConfigError(f"CHECKPOINT_DIR {ckpt} is damaged: {problem}; export an older checkpoint")
    return ckpt


def _plan(args: argparse.Namespace) -> tuple[str, str, int, int]:
    """(model dir, tokenizer dir, tp, pp) for this checkpoint; ConfigError naming the argument and the fix."""
    from pacs_megatron.config import ParallelConfig
    from pacs_megatron.parallel import check_layout
    from pacs_megatron.run.resume import check_model_unchanged

    for flag, value in (("--tp", args.tp), ("--pp", args.pp)):
        if value < 0:
            raise ConfigError(f"{flag} {value} must be >= 1 (or 0: the checkpoint's own)")
    ckpt = _checkpoint_dir(args.checkpoint)
    if Path(args.out).resolve().is_relative_to(ckpt.resolve()):
        raise ConfigError(f"OUT_DIR {args.out} is inside the checkpoint {ckpt}: write the export elsewhere")
    check_writable_dir("OUT_DIR", args.out)  # before any rank starts
    check_out_dir(Path(args.out), ckpt, getattr(args, "overwrite", False))
    extra = read_extra_state(ckpt)
    model_cfg = extra.get("config", {}).get("model", {})
    model_dir = args.model_dir or model_cfg.get("path")
    key = "--model-dir" if args.model_dir else f"the run's model.path (pass --model-dir to override; {ckpt})"
    if not model_dir:
        raise ConfigError(f"no HF config for {ckpt}: its extra_state.json names no model.path; pass --model-dir")
    tokenizer_dir = model_cfg.get("tokenizer") if not args.model_dir else ""
    lora = lora_of(extra)
    peft = lora is not None and not getattr(args, "merge", False)  # an adapter: no tokenizer files to copy
    hf = check_model_dir(
        key, model_dir, weights=False, tokenizer=not peft, tokenizer_key="model.tokenizer", tokenizer_dir=tokenizer_dir
    )
    check_model_unchanged(extra.get("model"), hf, ckpt)
    if peft and int(extra.get("reference_reset_step", 0)) > 0:
        raise ConfigError(
            f"{ckpt}: a PACS v2 reset (step {extra['reference_reset_step']}) merged this run's LoRA adapters into "
            "its base, so they are no adapter of the HF base any more: export it with --merge"
        )
    layout = load_common(ckpt / MEGATRON_DIR).get("layout", {})
    tp, pp = args.tp or layout.get("tp", 1), args.pp or layout.get("pp", 1)
    problem = export_base_problem(extra, ckpt, model_dir, tp, pp)  # an adapter-only LoRA checkpoint's base
    if problem:
        raise ConfigError(problem)
    problem = adapter_base_problem(extra, model_dir, ckpt) if peft else None
    if problem:
        raise ConfigError(problem)
    try:
        check_layout(ParallelConfig(tp=tp, pp=pp), hf, training=False)
    except ConfigError as e:
        raise ConfigError(str(e).replace("parallel.tp", "--tp").replace("parallel.pp", "--pp")) from None
    return model_dir, tokenizer_dir or model_dir, tp, pp


def adapter_base_problem(extra: dict, model_dir: str, ckpt: Path) -> str | None:
    """Why a PEFT adapter of this LoRA run would load onto nothing, or None: its base has no weights on disk
    (``model.init`` tiny or random: the run drew them from its seed, so only the merged export holds them)."""
    init = extra.get("config", {}).get("model", {}).get("init", "pretrained")
    on_disk = any(any(Path(model_dir).glob(p)) for p in WEIGHT_PATTERNS)
    if init in WEIGHT_INITS and on_disk:
        return None
    why = f"the run's model.init={init} drew them at random" if init not in WEIGHT_INITS else "none found"
    return (
        f"{ckpt}: a PEFT adapter needs its base's weights on disk, and {model_dir} holds none ({why}): export a "
        "whole model with --merge"
    )


def lora_of(extra: dict):
    """The run's ``actor.lora`` (a LoRAConfig) when it trained adapters, else None."""
    from pacs_megatron.config import LoRAConfig

    cfg = extra.get("config", {}).get("actor", {}).get("lora") or {}
    lora = LoRAConfig(**cfg) if cfg else None
    return lora if lora is not None and lora.enabled else None


def run(args: argparse.Namespace, model_dir: str, tokenizer_dir: str, tp: int, pp: int) -> int:
    """One rank's work: build the model chunks, load their weights, write the HF files (collective)."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from pacs_megatron.actor.actor import resolve_dtype
    from pacs_megatron.actor.checkpoint import load_model_weights
    from pacs_megatron.actor.lora.export import save_peft_adapter
    from pacs_megatron.actor.policy_model import build_policy_model
    from pacs_megatron.actor.weights import load_hf_weights, save_hf
    from pacs_megatron.config import ParallelConfig
    from pacs_megatron.hf.spec import model_spec_from_hf
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
        extra = read_extra_state(ckpt)
        lora, run_model = lora_of(extra), extra.get("config", {}).get("model", {})
        # The run's seed: an adapter-only LoRA checkpoint's random base is drawn again, the rest is overwritten
        # (the adapters' entries are in the checkpoint beside their frozen bases). No base here: see load_base.
        _, chunks = build_policy_model(spec, groups, dtype, seed=int(run_model.get("seed", 0)), lora=lora)
        pretrained = run_model.get("init", "pretrained") in WEIGHT_INITS  # an adapter-only checkpoint's base
        load_base = (lambda: load_hf_weights(chunks, spec, model_dir, groups)) if pretrained else None
        load_model_weights(chunks, ckpt, load_base)  # model only: optimizer state stays
        out_dtype = None if args.dtype == "auto" else resolve_dtype(args.dtype, on_gpu)
        if groups.rank == 0 and Path(args.out).is_dir():
            removed = clear_weights(Path(args.out))
            if removed:
                logger.info("removed the earlier weights in %s: %s", args.out, ", ".join(removed))
        if lora is not None and not getattr(args, "merge", False):
            save_peft_adapter(chunks, spec, groups, lora, model_dir, args.out)
        else:  # LoRA with --merge: save_hf writes W + (alpha / r) B A (actor/weights.py)
            save_hf(chunks, spec, groups, hf_config, args.out, tokenizer_dir, out_dtype)
        if groups.rank == 0:
            record = {"run": _run_dir(ckpt), "checkpoint": str(ckpt.resolve()), "tp": tp, "pp": pp}
            record["format"] = "hf" if lora is None or getattr(args, "merge", False) else "peft-lora"
            if record["format"] == "peft-lora":  # the base as the adapter saw it: its weights rounded to this dtype
                record["base_model"] = str(Path(model_dir).resolve())
                record["base_dtype"] = str(dtype).removeprefix("torch.")
                logger.info(
                    "the adapter was trained on %s in %s: load the base in that dtype to reproduce the run's "
                    "log-probs (a base loaded in another dtype differs by its rounding; --merge writes the model "
                    "as trained)",
                    record["base_model"],
                    record["base_dtype"],
                )
            (Path(args.out) / RECORD).write_text(json.dumps(record, indent=2) + "\n")
            logger.info("exported %s (loaded at tp=%d pp=%d) to %s", ckpt, tp, pp, args.out)
        return 0
    finally:
        destroy_parallel()


def main(args: argparse.Namespace) -> int:
    init_logging()
    model_dir, tokenizer_dir, tp, pp = _plan(args)  # a ConfigError is one line, exit 2 (cli.py's boundary)
    argv = ["pacs_megatron", "export", args.checkpoint, args.out, "--tp", str(tp), "--pp", str(pp)]
    argv += ["--dtype", args.dtype] + (["--model-dir", args.model_dir] if args.model_dir else [])
    argv += ["--overwrite"] if getattr(args, "overwrite", False) else []
    argv += ["--merge"] if getattr(args, "merge", False) else []
    return on_ranks(argv, tp * pp, lambda: run(args, model_dir, tokenizer_dir, tp, pp))


if __name__ == "__main__":
    from pacs_megatron.cli import run as run_command

    sys.exit(run_command("export", sys.argv[1:], prog="pacs_megatron.tools.export"))
