"""The pieces every end-to-end test of the trainer uses: the command line of a short CPU-default run,
and the metrics it logged. Launch-specific helpers (Slurm, torchrun) live in tests/launch/."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "cpu_tiny.yaml"
SHORT = [
    "trainer.train_batch_size=10",
    "rollout.n=4",
    "algorithm.micro_batch_size=20",
    "trainer.sft_warmup_steps=1",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]
"""Overrides that make the CPU default a run of a few seconds (10 prompts x 4, one warm-up step)."""
NONDETERMINISTIC = (
    "timing/", "perf/", "sync/seconds", "sync/gbytes_per_s", "async/trainer_wait_s", "async/engine_busy_s",
    "async/engine_idle_s",
)  # fmt: skip
"""Metric keys whose values depend on the wall clock or on what the process did before, not on the maths."""


def train_cmd(out: Path, steps: int, *overrides: str, config: Path = CONFIG) -> list[str]:
    """``python -m pacs_megatron train`` of ``config`` for ``steps`` steps, writing to ``out``."""
    return [
        sys.executable,
        "-m",
        "pacs_megatron",
        "train",
        "--config",
        str(config),
        f"trainer.output_dir={out}",
        f"model.path={out}/model",
        f"trainer.total_steps={steps}",
        *overrides,
    ]


def metrics_rows(out: Path) -> dict[int, dict]:
    """step -> the metrics row of ``out/metrics.jsonl`` ({} when absent)."""
    path = out / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return {r["step"]: r for r in rows}


def wait_for(pred, timeout: float, proc: subprocess.Popen) -> None:
    """Poll ``pred`` until true; fail if the run ``proc`` exits first or ``timeout`` seconds pass."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run exited early with {proc.returncode}")
        time.sleep(0.2)
    raise AssertionError("timed out waiting for the run")
