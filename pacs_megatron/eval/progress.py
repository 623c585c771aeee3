"""Progress of a long evaluation: a rich bar on a terminal, plain log lines with ETA otherwise.

    with EvalProgress(total=500, what="problems", chunk=64) as progress:
        ...; progress.advance(64)      # evaluate(..., progress=progress) generates chunk by chunk

A log file or a batch job's stdout gets one line per tenth of the work (and at the end) instead of
bar redraws; rank 0 only, like every log line. The training loop's validation (eval/runner.py, sharded)
uses the plain lines always (training's own bar is live on a terminal, and rich draws one live display at
a time), counts samples (problems x n), and stays silent for its first ``quiet_s`` seconds, so the tiny
recipe's one-second validation prints no progress while a 9-minute one (the SmolLM2 recipe's step 0,
issue 42) prints a line per tenth with its ETA.
"""

from __future__ import annotations

import sys
import time

from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class EvalProgress:
    """Counts ``advance(k)`` calls up to ``total``; draws a bar when stderr is a terminal."""

    def __init__(
        self,
        total: int,
        what: str = "problems",
        chunk: int = 64,
        tty: bool | None = None,
        label: str = "sampled",
        per_item: int = 1,
        quiet_s: float = 0.0,
    ) -> None:
        self.total, self.what, self.done = max(1, total), what, 0
        self.chunk = max(1, chunk)
        """Prompts per generate call when the caller reports progress by chunks."""
        self.label = label
        """What the line starts with (``sampled``; ``validation (step 50):``)."""
        self.per_item = max(1, per_item)
        """Shown units per counted item (``n`` samples per problem: the line counts samples)."""
        self.quiet_s = quiet_s
        """No line before this many seconds (and then no closing line either, if none was printed)."""
        self.start = time.monotonic()
        self._next_line = 0.1
        self._printed = False
        self._bar = None
        if sys.stderr.isatty() if tty is None else tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn(f"[bold]eval {what}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._task = self._bar.add_task("eval", total=self.total)

    def __enter__(self) -> EvalProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, k: int) -> None:
        self.done = min(self.total, self.done + k)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            return
        frac = self.done / self.total
        if frac >= self._next_line or self.done == self.total:
            elapsed = time.monotonic() - self.start
            if elapsed >= self.quiet_s or (self.done == self.total and self._printed):
                eta = elapsed / frac - elapsed if frac > 0 else 0.0
                logger.info(
                    "%s %d/%d %s (%d%%), %s elapsed, ETA %s",
                    self.label,
                    self.done * self.per_item,
                    self.total * self.per_item,
                    self.what,
                    round(100 * frac),
                    _fmt(elapsed),
                    _fmt(eta),
                )
                self._printed = True
            while self._next_line <= frac:
                self._next_line += 0.1
