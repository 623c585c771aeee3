"""How a run ends and what a second command on its directory does (issue 42):

- a run whose ``total_steps`` is not a multiple of ``test_freq`` still validates at its last step;
- launching a finished run again says "already complete" from the run directory, without spawning ranks;
- ``--dry-run`` works beside a running run (it takes no lock).

One 3-step run of the tiny recipe on two gloo ranks (~1-2 min on a loaded 2-core box)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "cpu_tiny.yaml"
SMALL = ["trainer.train_batch_size=10", "trainer.sft_warmup_steps=1", "logging.progress_bar=false"]


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pacs_megatron", "train", "--config", str(CONFIG), f"trainer.output_dir={out}"]
    cmd += [f"model.path={out}/model", *SMALL, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.distributed
def test_final_validation_finished_run_and_dry_run_beside_a_live_lock(tmp_path):
    out = tmp_path / "run"
    steps = ["trainer.total_steps=3", "trainer.test_freq=2"]
    first = _train(out, *steps)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    validated = [r["step"] for r in rows if "val/arith/pass@1" in r]
    assert validated == [2, 3]  # fails on the old code: [2] (the last step was not a multiple of test_freq)

    again = _train(out, *steps)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "run already complete at step 3" in again.stderr
    assert "local ranks" not in again.stderr and "resuming from" not in again.stderr  # fails on the old code
    assert json.loads((out / "final.json").read_text())["status"] == "complete"  # the run's own record stays

    from pacs_megatron.run.run_dir import LOCK, this_process

    (out / LOCK).write_text(json.dumps(asdict(this_process())))  # this live process holds the run
    dry = _train(out, "trainer.total_steps=5", "--dry-run")
    assert dry.returncode == 0, dry.stderr[-3000:]  # fails on the old code: refused by the lock
    assert "# layout" in dry.stdout
    busy = _train(out, "trainer.total_steps=5")
    assert busy.returncode == 2 and "is in use by another run" in busy.stderr, busy.stderr[-2000:]  # a real run is
