"""``model.dtype=auto`` resolved for the machine a run starts on (issue 58): one line, in the run's record.

bfloat16 on a GPU, or on a CPU with native bf16 (``avx512_bf16``: AVX512-BF16, e.g. Zen 4/5, Cooper Lake;
``amx_bf16``: AMX, Sapphire Rapids and later; read from ``/proc/cpuinfo``); float32 elsewhere: without them
torch emulates bf16 (an AVX2 Zen 3 runs a bf16 step slower than an fp32 one), and the comparisons were run in
fp32 there for that reason. A run resumed from a checkpoint keeps the dtype it started with (the checkpoint's
saved config), on whatever machine it resumes, and says so: changing the parameters' dtype mid-run would
change what the run computes.

Resolved in the launch (``launch/cli.py``, every process that runs ``train``: the spawner and each rank, which
see the same machine), before the preflight: from there on ``cfg.model.dtype`` is "float32" or "bfloat16", so
the saved configs (``configs/launch_*.yaml``, ``config.yaml``), the checkpoints' ``extra_state.json`` and
``final.json`` record the resolved value. An explicit value is left as it is, so whatever keys a run by its
explicit settings (tools/compare/runs.py) keys it as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pacs_megatron.config import RunConfig
from pacs_megatron.run.run_record import DTYPE_REASON_ENV
from pacs_megatron.utils.cpu import cpu_bf16_flags
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class DtypeChoice:
    """What ``model.dtype`` a run uses and why.

    Example:
        >>> choose_dtype("auto", on_gpu=False, bf16_flags=[]).dtype
        'float32'
    """

    dtype: str
    """"float32" or "bfloat16"."""
    reason: str
    """Why, in words (logged, written beside the config and into final.json)."""

    def line(self) -> str:
        return f"model.dtype={self.dtype}: {self.reason}"


def choose_dtype(
    requested: str, on_gpu: bool, bf16_flags: list[str], started_with: str | None = None, checkpoint: str = ""
) -> DtypeChoice:
    """The dtype for ``requested`` ("auto", "float32", "bfloat16") here; ``started_with``: the resolved dtype of
    the checkpoint this launch resumes (its saved config), which an "auto" run keeps."""
    if requested != "auto":
        return DtypeChoice(requested, "set in the config")
    if on_gpu:
        here, why = "bfloat16", "a GPU run"
    elif bf16_flags:
        here, why = "bfloat16", f"this CPU has native bf16 ({', '.join(bf16_flags)})"
    else:
        here, why = "float32", "this CPU has no native bf16 (no avx512_bf16 / amx_bf16 flag): bf16 would be emulated"
    if started_with in ("float32", "bfloat16"):
        also = "" if started_with == here else f"; this machine alone would pick {here} ({why})"
        return DtypeChoice(started_with, f"auto, kept from the run's start (checkpoint {checkpoint}){also}")
    return DtypeChoice(here, f"auto: {why}")


def _resumed_dtype(cfg: RunConfig) -> tuple[str | None, str]:
    """The resolved model.dtype of the checkpoint this launch would resume, and its path (None, "" when none)."""
    from pacs_megatron.run.checkpoint import CheckpointManager
    from pacs_megatron.run.checkpoint_check import read_extra_state

    t = cfg.trainer
    if t.resume == "never" or t.overwrite:
        return None, ""
    path = CheckpointManager(t.output_dir).latest() if t.resume == "auto" else Path(t.resume)
    if path is None:
        return None, ""
    try:
        saved = read_extra_state(path).get("config") or {}
    except (OSError, ValueError):
        return None, ""  # damaged or missing: the ranks fall back to an older checkpoint and say so
    return (saved.get("model") or {}).get("dtype"), str(path)


def resolve_model_dtype(cfg: RunConfig, log: bool = True) -> DtypeChoice:
    """Set ``cfg.model.dtype`` to its resolved value (in place), put the reason where the run's record reads it
    (:data:`~pacs_megatron.run.run_record.DTYPE_REASON_ENV`) and log it as one line when ``log``."""
    from pacs_megatron.launch.checks.device import runs_on_cpu

    started_with, checkpoint = _resumed_dtype(cfg) if cfg.model.dtype == "auto" else (None, "")
    on_gpu = not runs_on_cpu(cfg.parallel.backend)
    choice = choose_dtype(cfg.model.dtype, on_gpu, cpu_bf16_flags(), started_with, checkpoint)
    cfg.model.dtype = choice.dtype
    os.environ[DTYPE_REASON_ENV] = choice.reason
    if log:
        logger.info("%s", choice.line())
    return choice
