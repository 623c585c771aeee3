"""The pieces every end-to-end test of the trainer uses: the command line of a short CPU-default run,
and the metrics it logged. Launch-specific helpers (Slurm, torchrun) live in tests/launch/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
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
    "timing/", "perf/", "sync/seconds", "sync/gbytes_per_s", "sync/bitwise_seconds", "async/trainer_wait_s",
    "async/engine_busy_s", "async/engine_idle_s",
)  # fmt: skip
"""Metric keys whose values depend on the wall clock or on what the process did before, not on the maths."""


def deterministic(row: dict) -> dict:
    """A metrics row without its :data:`NONDETERMINISTIC` keys: what two runs of the same maths log alike."""
    return {k: v for k, v in row.items() if not k.startswith(NONDETERMINISTIC)}


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


def files_under(out: Path) -> list[tuple[str, int]]:
    """(path, size) of every file under ``out``: what a run's progress looks like from outside."""
    found = []
    for path in out.rglob("*") if out.is_dir() else ():
        try:
            found.append((str(path), path.stat().st_size))
        except FileNotFoundError:  # a checkpoint's temporary directory, renamed as we looked
            pass
    return sorted(found)


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


def run_watched(cmd: list[str], out: Path, stall: float = 300, cap: float = 1200, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kw)`` whose limit is ``stall`` seconds with no
    progress (its output, the files under ``out``) rather than a fixed total, up to ``cap`` seconds in all
    (``wait_until`` with ``progress``); the run is killed on a timeout.

    A hang still fails ``stall`` seconds after the run's last sign of life; a start that keeps moving on a
    loaded machine is waited for: on this 2-core box beside CPU burners, a Ray run took 3 min to its first
    file and ran past the 300 s its test had allowed for the whole run (2026-11-26)."""
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, text=True, **kw)
        progress = lambda: (os.fstat(so.fileno()).st_size, os.fstat(se.fileno()).st_size, files_under(out))  # noqa: E731
        try:
            wait_until(lambda: proc.poll() is not None, stall, f"{' '.join(cmd[:4])}...", progress=progress, cap=cap)
        except AssertionError as e:
            proc.kill()
            proc.wait()
            so.seek(0), se.seek(0)
            raise AssertionError(f"{e}:\n" + (so.read() + se.read())[-3000:]) from None
        so.seek(0), se.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, so.read(), se.read())


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
