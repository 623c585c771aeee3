"""Reward safety in a real CPU-default run (2 ranks, num_workers=0): a reward that hangs on some
responses costs timeouts, not the run; one that fails on everything stops the run after
reward.max_failure_steps with one error naming it, once per rank, and no traceback. The first run
also checks the post-update PACS diagnostics (pacs/post_*) that a one-update-per-step run logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _runs import SHORT

REPO = Path(__file__).resolve().parents[2]
SMALL = ["trainer.total_steps=3", *SHORT]


def _run(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pacs_megatron", "train", "--config", str(REPO / "examples/configs/cpu_tiny.yaml")]
    cmd += [f"trainer.output_dir={out}", f"model.path={out}/model", *SMALL, *overrides]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


def _rows(out: Path) -> dict[int, dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


@pytest.mark.slow
@pytest.mark.distributed
def test_hanging_reward_and_post_update_diagnostics(tmp_path):
    res = _run(tmp_path, "reward.fn=reward_user_fns:arith_hangs_on_seven", "reward.timeout_s=1")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(tmp_path)
    assert sorted(rows) == [1, 2, 3]
    assert sum(r["reward/timeouts"] for r in rows.values()) > 0  # "7" was answered and cut off
    assert "Apex" not in res.stderr and "Transformer Engine" not in res.stderr
    for r in rows.values():
        # one update per step: the in-update loss is ln 2 by construction, the post-update one moved
        assert r["pacs/loss"] == pytest.approx(0.693147, abs=1e-5)
        assert r["pacs/post_loss"] != pytest.approx(0.693147, abs=1e-4)
        assert 0.0 <= r["pacs/post_classifier_acc"] <= 1.0 and r["pacs/post_psi_abs_mean"] > 0
    assert any(r["pacs/post_classifier_acc"] != 1.0 - r["reward/mean"] for r in rows.values())


@pytest.mark.slow
@pytest.mark.distributed
def test_reward_failing_everywhere_stops_the_run(tmp_path):
    res = _run(tmp_path, "reward.fn=reward_user_fns:always_raises", "reward.max_failure_steps=2")
    assert res.returncode == 1, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if " E " in ln and "failed on every response" in ln]
    assert len(errors) == 2, res.stderr[-3000:]  # rank 0's error and rank 1's one line
    assert "reward.fn='reward_user_fns:always_raises'" in errors[0] and "KeyError: 'answer_field'" in errors[0]
    assert "Traceback" not in res.stderr
    assert sorted(_rows(tmp_path)) == [1]  # step 2 found the second failing step and stopped
