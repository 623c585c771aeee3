"""Shared pieces of the launch tests: the short CPU run they all use and log readers."""

from __future__ import annotations

import json
from pathlib import Path

from _runs import CONFIG, REPO, SHORT, files_under, gone_within, wait_until  # noqa: F401 - re-exported for the launch tests


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
