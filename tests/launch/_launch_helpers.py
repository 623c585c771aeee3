"""Shared pieces of the launch tests: the short CPU run they all use and log readers."""

from __future__ import annotations

import json
import time
from pathlib import Path

from _runs import CONFIG, REPO, SHORT, files_under, wait_until  # noqa: F401 - re-exported for the launch tests


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
