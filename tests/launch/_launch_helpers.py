"""Shared pieces of the launch tests: the short CPU run they all use and log readers."""

from __future__ import annotations

import json
import time
from pathlib import Path

from _runs import CONFIG, REPO, SHORT, files_under  # noqa: F401 - re-exported for the launch tests


def short_run(out: Path, steps: int, *extra: str) -> list[str]:
    """Overrides for a few-second run of the CPU default (TP=2) writing to ``out``."""
    return [
        f"trainer.output_dir={out}",
        f"model.path={out}/model",
        f"trainer.total_steps={steps}",
        *SHORT,
        "trainer.log_rollouts=1",
        *extra,
    ]


def steps_of(path: Path) -> list[int]:
    """The ``step`` of every line of a JSONL log, in file order ([] when absent)."""
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


def wait_until(pred, timeout: float, what: str, alive=lambda: True, progress=None, cap: float = 900) -> float:
    """Poll ``pred`` until true; return the seconds waited. ``alive()`` False fails early.

    With ``progress`` (a callable whose value changes as the run advances: its log, its files), ``timeout``
    is the longest stretch with no change, not the whole wait: a start that keeps moving on a loaded
    machine is waited for (up to ``cap`` seconds), a stuck one still fails ``timeout`` seconds after its
    last sign of life. On this 2-core box beside two CPU burners, a Ray rank took 4 min from submission to
    its first step (2026-11-26), past the 240 s a test had allowed for the whole start."""
    start = last_change = time.monotonic()
    seen = progress() if progress else None
    while (now := time.monotonic()) - last_change < timeout and now - start < cap:
        if pred():
            return time.monotonic() - start
        if not alive():
            raise AssertionError(f"gave up waiting for {what}: the run ended")
        if progress and (value := progress()) != seen:
            seen, last_change = value, time.monotonic()
        time.sleep(0.2)
    quiet = f", {time.monotonic() - last_change:.0f}s without progress" if progress else ""
    raise AssertionError(f"timed out after {time.monotonic() - start:.0f}s waiting for {what}{quiet}")


def gone_within(pid: int, seconds: float) -> bool:
    """True once ``pid`` no longer runs (exited, or a zombie its parent has not reaped yet)."""
    import psutil

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False
