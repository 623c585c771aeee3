"""Per-step metrics: ``OUTPUT_DIR/metrics.jsonl`` (one JSON object per step), TensorBoard, optional
wandb, and a rich progress bar with ETA (a plain log line with ETA when the output is not a
terminal). Only rank 0 writes; other ranks get a no-op writer.

On resume, :meth:`MetricsWriter.truncate_after` drops what the interrupted launch logged after the
checkpoint, from metrics.jsonl, rollouts.jsonl and TensorBoard (``purge_step``), so no step is
recorded twice.

Metrics are plain ``dict[str, float]`` with namespaced keys (``reward/mean``, ``pacs/loss``,
``timing/step_s``...), returned by the functions that compute them and merged here.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pacs_megatron.run.layout import RunLayout
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


def format_metrics(metrics: dict[str, Any]) -> str:
    """``{"sft/loss": 2.514111, "actor/lr": 0.0003}`` -> ``"sft/loss=2.514 actor/lr=0.0003"``: a metrics dict
    as one readable log line (4 significant digits), not Python's repr.

    Example:
        >>> format_metrics({"sft/loss": 2.514111280441284, "actor/lr": 0.0003, "actor/skipped_steps": 0.0})
        'sft/loss=2.514 actor/lr=0.0003 actor/skipped_steps=0'
    """
    return " ".join(f"{k}={to_float(v):.4g}" for k, v in metrics.items())


def to_float(v: Any) -> float:
    if hasattr(v, "detach"):  # a tensor; torch is not imported for it (a launcher's parent logs without it)
        return float(v.detach().float().item())
    return float(v)


class PhaseTimer:
    """Wall time per named phase of a step: ``with timer("rollout"): ...`` -> ``timing/rollout_s``; and
    this process's CPU time in it (all its threads), ``timing/rollout_cpu_s``: on a machine shared with
    other work the CPU time still measures the phase's own work (bench/rl_step.py prints both)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            for key, spent in (
                (f"timing/{name}_s", time.perf_counter() - start),
                (f"timing/{name}_cpu_s", time.process_time() - cpu),
            ):
                self.times[key] = self.times.get(key, 0.0) + spent


class MetricsWriter:
    """The one writer of the run's per-step logs (rank 0 only): a JSON line per step in ``metrics.jsonl``,
    mirrored to TensorBoard / wandb, and a few of the step's samples in ``rollouts.jsonl``."""

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
        layout = RunLayout(Path(output_dir))
        self.path = layout.metrics
        self.side_logs = [p for p in layout.jsonl_logs if p != self.path]
        """Other per-step JSONL files (rows with a "step" key), trimmed with metrics.jsonl."""
        self.rollouts = layout.rollouts
        self._tb_dir = layout.tensorboard if tensorboard else None
        self._purge_step: int | None = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logging.wandb_project is set but wandb is not installed: pip install wandb") from e
            self._wandb = wandb.init(project=wandb_project, name=run_name or None, config=config, resume="allow")

    def truncate_after(self, step: int) -> None:
        """Drop records of steps > ``step`` (a resumed run rewrites what the killed run logged after its
        last checkpoint, so no log holds a step twice); TensorBoard hides them via ``purge_step``.

        ``step=0`` with rows of later steps is a run restarted from scratch (``--resume auto`` found no
        valid checkpoint): those rows are not dropped but kept aside, whole, in
        ``metrics.before-restart-<time>.jsonl`` (and the same for ``rollouts.jsonl``), with a warning."""
        if not self.enabled:
            return
        if step > 0:
            self._purge_step = step + 1
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for path in [self.path, *self.side_logs]:
            if path.exists():
                rows = [ln for ln in path.read_text().splitlines() if ln.strip()]
                later = [ln for ln in rows if json.loads(ln).get("step", 0) > step]
                if step == 0 and later:
                    aside = path.with_name(f"{path.stem}.before-restart-{stamp}{path.suffix}")
                    os.replace(path, aside)
                    if path == self.path:
                        logger.warning(
                            "no checkpoint to resume from in %s: the run restarts at step 0; the %d rows of the "
                            "earlier attempt (up to step %d) are kept in %s",
                            path.parent,
                            len(rows),
                            max(json.loads(ln).get("step", 0) for ln in later),
                            aside,
                        )
                    continue
                path.write_text("".join(ln + "\n" for ln in rows if json.loads(ln).get("step", 0) <= step))

    def _tensorboard(self) -> Any:
        """The SummaryWriter, opened at the first log (after truncate_after set the purge step)."""
        if self._tb is None and self._tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self._tb_dir), purge_step=self._purge_step)
        return self._tb

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row: dict[str, Any] = {"step": step}
        for k, v in sorted(metrics.items()):
            f = to_float(v)
            row[k] = f if math.isfinite(f) else str(f)
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        tb = self._tensorboard()
        if tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, float):
                    tb.add_scalar(k, v, step)
            tb.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        parts = [
            f"{k.split('/')[-1] if k != 'reward/mean' else 'reward'}={row[k]:.4g}"
            for k in SUMMARY_KEYS
            if isinstance(row.get(k), float)
        ]
        if parts:  # a validation-only row (step 0) has its own per-set lines: no empty "step 0 |"
            logger.info("step %d | %s", step, " ".join(parts))

    def log_samples(self, samples: list[dict]) -> None:
        """Append a few of the step's rollouts (rows with their "step") to ``rollouts.jsonl``."""
        if self.enabled and samples:
            with self.rollouts.open("a") as fh:
                fh.writelines(json.dumps(x) + "\n" for x in samples)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class Progress:
    """Progress with ETA on rank 0: a rich bar on a terminal; otherwise (output to a file, a
    scheduler's log) a plain log line about every 5% of the run, since bar redraws would be noise."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self._bar = None
        self.total, self.start = total, start
        self._t0 = time.perf_counter()
        self._plain = enabled and not sys.stderr.isatty()
        self._every = max(1, (total - start) // 20)
        if not enabled or self._plain:
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

    def eta_line(self, step: int) -> str:
        """``"step 40/200 (20%), 12s elapsed, ETA 48s"`` from this launch's mean step time."""
        elapsed = time.perf_counter() - self._t0
        done = max(1, step - self.start)
        eta = elapsed / done * (self.total - step)
        pct = 100 * step / max(1, self.total)
        return f"step {step}/{self.total} ({pct:.0f}%), {format_duration(elapsed)} elapsed, ETA {format_duration(eta)}"

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if self._plain and ((step - self.start) % self._every == 0 or step == self.total):
            logger.info("progress: %s", self.eta_line(step))
        if self._bar is None:
            return
        reward = metrics.get("reward/mean")
        info = f"reward {to_float(reward):.3f}" if reward is not None else ""
        self._bar.update(self._task, completed=step, info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def format_duration(seconds: float) -> str:
    """``"42s"``, ``"3m05s"``, ``"2h07m"``.

    Example:
        >>> format_duration(42.4), format_duration(185), format_duration(7620)
        ('42s', '3m05s', '2h07m')
    """
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
