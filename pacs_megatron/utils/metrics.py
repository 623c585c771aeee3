"""Per-step metrics: ``OUTPUT_DIR/metrics.jsonl`` (one JSON object per step), TensorBoard, optional
wandb, and a rich progress bar with ETA. Only rank 0 writes; other ranks get a no-op writer.

Metrics are plain ``dict[str, float]`` with namespaced keys (``reward/mean``, ``pacs/loss``,
``timing/step_s``...), returned by the functions that compute them and merged here.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

# Shown in the one-line step summary, in this order, when present.
SUMMARY_KEYS = (
    "reward/mean",
    "pacs/loss",
    "policy/loss",
    "pacs/mixed_group_frac",
    "actor/grad_norm",
    "response/length_mean",
    "sync/max_logprob_diff",
    "timing/step_s",
)


def to_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().item())
    return float(v)


class PhaseTimer:
    """Wall time per named phase of a step: ``with timer("rollout"): ...`` -> ``timing/rollout_s``."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"timing/{name}_s"] = self.times.get(f"timing/{name}_s", 0.0) + time.perf_counter() - start


class MetricsWriter:
    """Appends one JSON line per step and mirrors it to TensorBoard / wandb (rank 0 only)."""

    def __init__(
        self,
        output_dir: str | Path,
        enabled: bool,
        tensorboard: bool = True,
        wandb_project: str = "",
        run_name: str = "",
        config: dict | None = None,
    ) -> None:
        self.enabled = enabled
        self._tb = self._wandb = None
        self.path = Path(output_dir) / "metrics.jsonl"
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(output_dir) / "tb"))
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logging.wandb_project is set but wandb is not installed: pip install wandb") from e
            self._wandb = wandb.init(project=wandb_project, name=run_name or None, config=config, resume="allow")

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps > ``step`` (a resumed run rewrites what the killed run logged after its
        last checkpoint, so the file never holds a step twice)."""
        if not self.enabled or not self.path.exists():
            return
        keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step}
        for k, v in sorted(metrics.items()):
            f = to_float(v)
            row[k] = f if math.isfinite(f) else str(f)
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, float):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        parts = [
            f"{k.split('/')[-1] if k != 'reward/mean' else 'reward'}={row[k]:.4g}"
            for k in SUMMARY_KEYS
            if isinstance(row.get(k), float)
        ]
        logger.info("step %d | %s", step, " ".join(parts))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class Progress:
    """A rich progress bar with ETA on rank 0, on a terminal only (a log file gets the per-step
    summary lines instead of bar redraws)."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self._bar = None
        if not (enabled and sys.stderr.isatty()):
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.progress import (
            Progress as RichProgress,
        )

        self._bar = RichProgress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._bar.add_task("train", total=total, completed=start, info="")
        self._bar.start()

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if self._bar is None:
            return
        reward = metrics.get("reward/mean")
        info = f"reward {to_float(reward):.3f}" if reward is not None else ""
        self._bar.update(self._task, completed=step, info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
