"""``pacs-megatron train --config FILE [a.b=c ...]``: validate, then run the trainer on every rank.

Under torchrun / srun the ranks already exist and each one runs :func:`pacs_megatron.loop.train.train`.
Started by hand, it spawns ``tp * pp * dp`` local ranks itself (like ``torchrun --standalone``), so
the README's command is one line. Configuration errors surface here, before any process or model
is started, as one line and exit 2 (the error boundary every command shares: launch/errors.py);
``--dry-run`` prints the resolved config and the layout and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pacs_megatron.utils.logging import get_logger, init_logging

if TYPE_CHECKING:
    from pacs_megatron.config import RunConfig

# Everything else is imported inside main(), and what a launch's parent process needs (config, preflight,
# layout, the local launcher) imports no torch: the ranks do (~2 s each, more on a loaded machine);
# tests/test_cli.py checks both.
logger = get_logger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML run config (examples/configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="config overrides as a.b.c=value")
    p.add_argument("--resume", default=None, help="'auto' (default), 'never', or a checkpoint dir (= trainer.resume)")
    p.add_argument(
        "--overwrite", action="store_true", help="with --resume never: move an old run in the output dir aside"
    )
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and layout, then exit")


def layout_summary(cfg: RunConfig) -> dict:
    """What a run would look like, from the config and the model's config.json when present."""
    from pacs_megatron.config import ConfigError
    from pacs_megatron.parallel.layout import check_layout

    par = cfg.parallel
    out = {
        "world_size": par.world_size,
        "tp": par.tp,
        "pp": par.pp,
        "vpp": par.vpp,
        "cp": par.cp,
        "dp": par.dp,
        "prompts_per_step": cfg.trainer.train_batch_size,
        "sequences_per_step": cfg.trainer.train_batch_size * cfg.rollout.n,
        "optimizer_steps_per_rl_step": cfg.trainer.train_batch_size
        // cfg.mini_batch_prompts
        * cfg.algorithm.ppo_epochs,
        "sequences_per_dp_rank_per_minibatch": cfg.mini_batch_prompts // par.dp * cfg.rollout.n,
        "micro_batches_per_minibatch": cfg.mini_batch_prompts
        // par.dp
        * cfg.rollout.n
        // cfg.algorithm.micro_batch_size,
        "loss": cfg.algorithm.loss,
        "engine": cfg.rollout.engine,
    }
    config_json = Path(cfg.model.path) / "config.json"
    if config_json.is_file():
        hf = json.loads(config_json.read_text())
        out["model"] = {
            k: hf.get(k)
            for k in (
                "model_type",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
            )
        }
        check_layout(cfg.parallel, hf)  # heads/KV heads over TP, layers over PP x VPP
    elif cfg.model.init == "gguf":  # imported by the first run: the layout is checked on the GGUF's own shape
        from pacs_megatron.hf.gguf_import import read_gguf_info

        check_layout(cfg.parallel, read_gguf_info(cfg.model.gguf).config)
    elif cfg.model.init != "tiny":
        raise ConfigError(
            f"model.path={cfg.model.path!r} has no config.json: point it at a Hugging Face model directory"
        )
    return out


def finished_run(cfg: RunConfig) -> bool:
    """The run in ``trainer.output_dir`` already reached ``trainer.total_steps`` (its newest valid checkpoint,
    under ``--resume auto``): log its summary as "already complete" (final.json, rank 0) without spawning
    ranks or loading the checkpoint (which took 42 s on a loaded 2-core box to say "nothing to train").
    False when there is work left, or an export (``trainer.export_hf``) still to write, which needs the ranks."""
    from pacs_megatron.run.checkpoint import CheckpointManager
    from pacs_megatron.run.checkpoint_check import checkpoint_problem
    from pacs_megatron.run.layout import StepLayout
    from pacs_megatron.run.resume import ResumePlan
    from pacs_megatron.run.run_record import RunRecord

    t = cfg.trainer
    if t.resume != "auto" or t.overwrite:
        return False
    valid = [(s, p) for s, p in reversed(CheckpointManager(t.output_dir).complete()) if checkpoint_problem(p) is None]
    if not valid or valid[0][0] < t.total_steps:
        return False
    step, path = valid[0]
    if t.export_hf and not (StepLayout(path).hf / "config.json").is_file():
        return False
    is_rank0 = int(os.environ.get("RANK", "0")) == 0
    RunRecord(cfg, Path(t.output_dir), is_rank0, ResumePlan(path, step)).finish(step, path, status="already_complete")
    return True


def main(args: argparse.Namespace) -> int:
    from pacs_megatron.config import load_config, to_yaml
    from pacs_megatron.launch.checks.preflight import preflight
    from pacs_megatron.launch.local import on_ranks
    from pacs_megatron.launch.slurm import apply_srun_env
    from pacs_megatron.utils.dist import under_launcher
    from pacs_megatron.utils.early_signals import restore_default_handlers

    init_logging()
    if not under_launcher():  # this process is the launch: the run's wall time counts from here (run_record.py)
        from pacs_megatron.run.run_record import mark_launch

        mark_launch()
    overrides = list(args.overrides) + ([f"trainer.resume={args.resume}"] if args.resume else [])
    if getattr(args, "overwrite", False):
        overrides.append("trainer.overwrite=true")
    if args.dry_run:
        overrides.append("trainer.dry_run=true")
    # A ConfigError from here on is one line and exit 2 (the CLI's error boundary, launch/errors.py).
    cfg = load_config(args.config, overrides)
    # model.dtype=auto -> float32 / bfloat16 for this machine (launch/dtype.py), in the process that trains (and a
    # dry run): a spawner imports no torch, and its ranks, on the same machine, resolve it themselves
    trains_here = under_launcher() or (cfg.parallel.world_size == 1 and cfg.rollout.placement != "separate")
    if (trains_here and cfg.launcher.kind != "ray") or cfg.trainer.dry_run:
        from pacs_megatron.launch.dtype import resolve_model_dtype

        resolve_model_dtype(cfg, log=int(os.environ.get("RANK", "0")) == 0)
    preflight(cfg)  # model paths, reward.fn, --resume, run dir, data files: before any rank or model starts
    layout = layout_summary(cfg)
    try:
        if cfg.launcher.kind != "ray":  # a Ray driver inside a multi-task srun step is no rank
            apply_srun_env()  # srun started this rank directly (examples/slurm): RANK etc. from SLURM_*
    except RuntimeError as e:  # no MASTER_ADDR and scontrol cannot name the first node
        logger.error("%s", e)
        return 2
    if cfg.trainer.dry_run:
        sys.stdout.write(to_yaml(cfg) + "\n# layout\n" + json.dumps(layout, indent=2) + "\n")
        return 0
    if finished_run(cfg):  # "already complete", from the run dir alone
        return 0
    separate = cfg.rollout.placement == "separate"  # engine processes beside the ranks (docs/async.md)
    if not (under_launcher() or (cfg.parallel.world_size == 1 and not separate)):
        restore_default_handlers()  # a driver or spawner, not a rank: it installs its own forwarding
    if cfg.launcher.kind == "ray" and not under_launcher():
        from pacs_megatron.launch.ray_launcher import main as ray_main  # ray is imported only here

        return ray_main(cfg)
    if cfg.launcher.kind == "torchrun" and not under_launcher():
        logger.error("launcher.kind=torchrun but RANK/WORLD_SIZE are not set: start with torchrun or srun")
        return 2
    argv = ["pacs_megatron", "train", "--config", args.config, *overrides]
    return on_ranks(argv, cfg.parallel.world_size, lambda: _train_here(cfg), engines=cfg if separate else None)


def _train_here(cfg: RunConfig) -> int:
    """This process is a rank (or the only one): train. Under torchrun / srun, with rollout.placement=separate,
    trainer rank 0 starts the engine processes (no launcher of ours did) and stops them after."""
    from pacs_megatron.launch.engine_rank import engines_for_rank
    from pacs_megatron.launch.local import stop_engines
    from pacs_megatron.launch.rank import run_rank
    from pacs_megatron.launch.slurm import srun_exit_code
    from pacs_megatron.loop.train import train

    engines = engines_for_rank(cfg)
    try:
        # srun: 75 means "checkpointed, requeue me"; run_rank: one error per job, not one traceback per rank
        return srun_exit_code(run_rank(train, cfg))
    finally:
        stop_engines(engines)
