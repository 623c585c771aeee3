"""The comparison harness on a tiny budget: 2 methods x 2 seeds x 3 steps (TP=1, one lr: no
tuning phase), JSON summary, table and PNG; a rerun is resumable (finished runs are not redone)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pacs_megatron.tools.compare import Runner, interval, run_score

REPO = Path(__file__).resolve().parents[2]


def test_interval_and_score_by_hand():
    s = interval([0.2, 0.4])
    assert s["mean"] == pytest.approx(0.3) and s["n"] == 2
    assert s["half_width"] == pytest.approx(12.706 * math.sqrt(0.02) / math.sqrt(2))
    assert math.isnan(interval([1.0])["half_width"])
    rows = [{"step": i, "reward/mean": float(i)} for i in range(1, 9)]
    for r in rows[1::2]:
        r["val/x/pass@1"] = r["step"] / 10
    # last three validations: steps 4, 6, 8; last quarter of the train reward: steps 7, 8
    assert run_score(rows, "val/x/pass@1") == (pytest.approx(0.6), pytest.approx(7.5))


@pytest.mark.slow
def test_compare_tiny_budget_writes_json_and_png(tmp_path):
    from pacs_megatron.cli import main

    out = tmp_path / "cmp"
    argv = [
        "compare",
        "--config",
        str(REPO / "examples" / "configs" / "cpu_generalize.yaml"),
        "--out",
        str(out),
        "--methods",
        "pacs,ppo",
        "--seeds",
        "2",
        "--lrs",
        "1e-3",
        "--steps",
        "3",
        "--jobs",
        "2",
        "parallel.tp=1",
        "trainer.train_batch_size=4",
        "algorithm.mini_batch_size=4",
        "rollout.n=4",
        "algorithm.micro_batch_size=16",
        "trainer.sft_warmup_steps=1",
        "trainer.test_freq=3",
        "trainer.save_freq=0",
        "trainer.val_n=2",
        "trainer.val_k=[1]",
    ]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_key"] == "val/arith_heldout/pass@1"
    for method in ("pacs", "ppo"):
        s = summary["methods"][method]
        assert s["seeds"] == [0, 1] and s["final_heldout"]["n"] == 2
        assert s["curves"]["reward/mean"]["step"] == [1, 2, 3]
        assert math.isfinite(s["final_train_reward"]["half_width"])
    assert (out / "curves.png").stat().st_size > 10_000
    assert "| pacs | 0.001 | 2 |" in (out / "summary.md").read_text()
    # Resumable: every run is done, so a rerun launches nothing and rewrites the same summary.
    stamp = {p: p.stat().st_mtime for p in out.glob("runs/*/metrics.jsonl")}
    assert main(argv) == 0
    assert {p: p.stat().st_mtime for p in out.glob("runs/*/metrics.jsonl")} == stamp


GENERALIZE = REPO / "examples" / "configs" / "cpu_generalize.yaml"
SMALL = [
    "parallel.tp=1",
    "trainer.train_batch_size=4",
    "algorithm.mini_batch_size=4",
    "rollout.n=4",
    "algorithm.micro_batch_size=16",
]


def test_runs_are_keyed_on_their_resolved_settings(tmp_path):
    import argparse

    def runner(steps, *extra):
        args = argparse.Namespace(config=str(GENERALIZE), out=str(tmp_path), steps=steps, overrides=[*SMALL, *extra])
        return Runner(args)

    spec = ("pacs", 1e-3, 0)
    four = runner(4).run_dir(*spec)
    assert four.parent == tmp_path / "runs" and four.name.startswith("pacs_lr0.001_s0-")
    assert runner(4).run_dir(*spec) == four  # same settings: the same run, resumed or reused
    assert runner(6).run_dir(*spec) != four  # --steps 6 after --steps 4: new runs
    assert runner(4, "trainer.val_temperature=0.5").run_dir(*spec) != four
    assert runner(4).run_dir("pacs", 1e-3, 1) != four


def test_compare_refuses_before_any_run_when_nothing_validates(tmp_path, capfd):
    from pacs_megatron.cli import main

    out = tmp_path / "cmp"
    argv = ["compare", "--config", str(GENERALIZE), "--out", str(out), "--steps", "4", *SMALL, "trainer.test_freq=0"]
    assert main(argv) == 2
    assert "trainer.test_freq=0 with trainer.total_steps=4 never validates" in capfd.readouterr().err
    assert not (out / "runs").exists()


@pytest.mark.distributed
def test_killing_compare_by_its_pid_stops_its_runs(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "pacs_megatron", "compare", "--config", str(GENERALIZE), "--out", str(out)]
    cmd += ["--methods", "pacs", "--seeds", "1", "--lrs", "1e-3", "--steps", "500", "--jobs", "1", *SMALL]
    cmd += ["trainer.test_freq=100"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        parent, end = psutil.Process(proc.pid), time.monotonic() + 120
        while not parent.children() and time.monotonic() < end:
            time.sleep(0.2)
        runs = parent.children(recursive=True)
        assert runs, "compare started no run"
        time.sleep(2.0)  # let the run get under way
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=180) != 0
        _, alive = psutil.wait_procs(runs, timeout=30)
        assert not alive, f"runs left going after compare was killed: {alive}"
    finally:
        proc.kill()
