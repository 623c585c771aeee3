"""The comparison harness: the tuning rules on synthetic metrics (grid growth until the optimum is
interior, the critic lr after the actor lr, tuning on its own key), then for real on a tiny budget:
2 methods x 2 seeds x 3 steps (TP=1) with a critic-lr tuning phase, JSON summary, tables and PNG; a
rerun is resumable (finished runs are not redone)."""

from __future__ import annotations

import json
import math

import pytest
from _compare_helpers import GENERALIZE, SMALL

from pacs_megatron.tools.compare.protocol import interval, run_score
from pacs_megatron.tools.compare.runs import Runner


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
        str(GENERALIZE),
        "--out",
        str(out),
        "--methods",
        "pacs,ppo",
        "--seeds",
        "2",
        "--lrs",
        "1e-3",
        "--critic-lrs",
        "1e-3,3e-3",
        "--tune-seeds",
        "1",
        "--max-extend",
        "0",
        "--tune-key",
        "val/arith_val/pass@1",
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
    assert summary["tune_key"] == "val/arith_val/pass@1"
    # Only the critic method tunes (one actor lr), on the tuning seed 1000: one run per critic lr.
    assert list(summary["tuning"]) == ["ppo"] and set(summary["tuning"]["ppo"]["critic_lr"]["scores"]) == {
        "0.001",
        "0.003",
    }
    assert sorted(p.name.split("-")[0] for p in out.glob("runs/ppo_*_s1000-*")) == [
        "ppo_lr0.001_clr0.001_s1000",
        "ppo_lr0.001_clr0.003_s1000",
    ]
    assert summary["methods"]["pacs"]["critic_lr"] is None
    assert summary["methods"]["ppo"]["critic_lr"] == summary["tuning"]["ppo"]["critic_lr"]["chosen"]
    for method in ("pacs", "ppo"):
        s = summary["methods"][method]
        assert s["seeds"] == [0, 1] and s["final_heldout"]["n"] == 2
        assert s["curves"]["reward/mean"]["step"] == [1, 2, 3]
        assert math.isfinite(s["final_train_reward"]["half_width"])
    assert (out / "curves.png").stat().st_size > 10_000
    md = (out / "summary.md").read_text()
    assert "| pacs | 0.001 | 2 |" in md and "Per seed:" in md and "| ppo | critic_lr | 0.001 |" in md
    per_seed = summary["methods"]["ppo"]["per_seed"]
    assert [r["seed"] for r in per_seed] == [0, 1]
    assert summary["methods"]["ppo"]["final_heldout"]["mean"] == pytest.approx(sum(r["heldout"] for r in per_seed) / 2)
    # Resumable: every run is done, so a rerun launches nothing and rewrites the same summary.
    stamp = {p: p.stat().st_mtime for p in out.glob("runs/*/metrics.jsonl")}
    assert main(argv) == 0
    assert {p: p.stat().st_mtime for p in out.glob("runs/*/metrics.jsonl")} == stamp


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
    # a setting spelled at its default (as a field a later version adds arrives) keeps the key: finished
    # runs of a long protocol stay reusable across versions
    assert runner(4, "rollout.multi_turn.max_turns=0", "sync.lora=merged").run_dir(*spec) == four


def test_a_finished_run_under_an_older_key_is_reused(tmp_path):
    """The key once hashed every field, so the H200's 11 finished SmolLM2 runs (docs/results/
    smollm2_pacs_gpu_partial) sat under keys no later version computed, and a lease would run them again:
    a finished run whose saved config gives this run's key is renamed to it; another setting's is not."""
    import argparse

    from omegaconf import OmegaConf

    from pacs_megatron.config import load_config

    args = argparse.Namespace(config=str(GENERALIZE), out=str(tmp_path), steps=4, overrides=SMALL)

    def finished(name, *extra):
        old = tmp_path / "runs" / name
        cfg = load_config(GENERALIZE, [*Runner(args).settings("pacs", 1e-3, 0), *extra, f"trainer.output_dir={old}"])
        old.mkdir(parents=True)
        OmegaConf.save(OmegaConf.structured(cfg), old / "config.yaml")
        (old / "final.json").write_text("{}")
        return old

    other = finished("pacs_lr0.001_s0-0123456789", "trainer.val_temperature=0.5")
    same = finished("pacs_lr0.001_s0-deadbeef00")
    new = Runner(args).run_dir("pacs", 1e-3, 0)
    assert new.name != same.name and (new / "final.json").is_file() and not same.exists()
    assert other.exists()  # other settings: left where they are, never reused


def test_a_pretrained_model_path_is_kept_and_a_built_model_goes_in_the_run_dir(tmp_path):
    """A run that builds its model (tiny / random / a GGUF import) writes it into its own directory; a
    run of a pretrained model loads the user's model.path, which compare must not redirect (it did: every
    `model.init=pretrained model.path=DIR` run failed with "no such directory" in its run dir)."""
    import argparse

    def command(*extra):
        args = argparse.Namespace(config=str(GENERALIZE), out=str(tmp_path), steps=4, overrides=[*SMALL, *extra])
        runner = Runner(args)
        paths = [a for a in runner.command("pacs", 1e-3, 0) if a.startswith("model.path=")]
        return paths[-1], runner.run_dir("pacs", 1e-3, 0)

    built, run_dir = command()
    assert built == f"model.path={run_dir}/model"
    kept, _ = command("model.init=pretrained", f"model.path={tmp_path / 'hf'}")
    assert kept == f"model.path={tmp_path / 'hf'}"


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
        # Until the run has a process of its own under its launcher (a rank, the engine): those must stop too.
        while len(parent.children(recursive=True)) < 2 and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        runs = parent.children(recursive=True)
        assert len(runs) >= 2, f"compare started no run with a process of its own: {runs}"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=180) != 0
        _, alive = psutil.wait_procs(runs, timeout=30)
        assert not alive, f"runs left going after compare was killed: {alive}"
    finally:
        proc.kill()


_SLOW_STEP = """
import signal, sys, time
def finish_step(signum, frame):  # a run told to stop checkpoints after its current step, here a slow one
    time.sleep(float(sys.argv[1]))
    sys.exit(143)
signal.signal(signal.SIGTERM, finish_step)
print("ready", flush=True)
time.sleep(600)
"""


def _slow_runs(tmp_path, step_s: float, count: int = 2) -> dict:
    import subprocess
    import sys

    running = {}
    for k in range(count):
        proc = subprocess.Popen([sys.executable, "-c", _SLOW_STEP, str(step_s)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        running[k] = (proc, (tmp_path / f"run{k}.log").open("w"))
    return running


@pytest.mark.subprocess
def test_stopping_waits_for_every_run_to_finish_its_step(tmp_path, monkeypatch):
    """A stopped run checkpoints after its current step, however long it takes: the old fixed 120 s
    grace killed a SmolLM2 run whose step under load took 165 s (here: a clock that jumps 200 s a
    reading makes any deadline pass; the old code then killed the runs, exit -9)."""
    from pacs_megatron.tools.compare import runs as compare_mod

    running = _slow_runs(tmp_path, step_s=1.0)
    procs = [p for p, _ in running.values()]
    clock = iter(range(0, 10**6, 200))
    monkeypatch.setattr(compare_mod.time, "monotonic", lambda: float(next(clock)))
    compare_mod._stop_runs(running)
    assert [p.returncode for p in procs] == [143, 143] and not running


@pytest.mark.subprocess
def test_a_second_signal_kills_the_runs_at_once(tmp_path):
    import os
    import signal
    import sys
    import threading
    import time

    from pacs_megatron.tools.compare.runs import _stop_runs

    running = _slow_runs(tmp_path, step_s=60.0)
    procs = [p for p, _ in running.values()]
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # as compare's main
    try:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        with pytest.raises(SystemExit):
            _stop_runs(running)
        assert time.monotonic() - t0 < 20
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2


def test_runs_sharing_a_gpu_are_pinned_and_capped(tmp_path, monkeypatch):
    """Concurrent runs on GPUs: each one-rank run goes to the least busy visible GPU and may hold only its
    share of that GPU's memory (PACS_CUDA_MEMORY_FRACTION, applied by parallel/groups.py). Without the cap,
    12 SmolLM2 runs on one H200 let their caching allocators fill it and 13 of 24 died of CUDA OOM."""
    import argparse

    from pacs_megatron.config import ConfigError
    from pacs_megatron.utils.devices import MEMORY_FRACTION_ENV, memory_fraction, share_gpus

    assert share_gpus(12, 1, ["0"]) == (12, 0.0708)
    assert share_gpus(2, 1, ["0", "1"]) == (1, None)  # one run a GPU: nothing to share
    assert share_gpus(4, 2, ["0", "1"]) == (4, 0.2125)
    assert share_gpus(8, 1, []) == (0, None)  # CPU runs: no GPU settings at all

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    args = argparse.Namespace(config=str(GENERALIZE), out=str(tmp_path), steps=4, overrides=SMALL, jobs=4)
    args.ranks_per_run = 1
    runner = Runner(args)
    envs = [runner.run_env(("pacs", 1e-3, seed)) for seed in range(4)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "5", "3", "5"]
    assert {e[MEMORY_FRACTION_ENV] for e in envs} == {"0.425"}
    del runner._gpu_of[("pacs", 1e-3, 2)]  # that run ended: its GPU is the least busy one
    assert runner.run_env(("pacs", 1e-3, 9))["CUDA_VISIBLE_DEVICES"] == "3"

    assert memory_fraction({MEMORY_FRACTION_ENV: "0.25"}) == 0.25 and memory_fraction({}) is None
    with pytest.raises(ConfigError, match=MEMORY_FRACTION_ENV):
        memory_fraction({MEMORY_FRACTION_ENV: "1.5"})


def test_a_vllm_engine_must_fit_its_share_of_a_shared_gpu():
    """A colocated vLLM engine sizes itself by a fraction of the whole GPU, outside the runs' allocator caps:
    runs sharing a GPU must ask for at most half their share (the actor keeps the other half)."""
    from pacs_megatron.config import ConfigError, load_config
    from pacs_megatron.tools.compare.runs import check_engine_share

    vllm = load_config(GENERALIZE, ["rollout.engine=vllm"])
    check_engine_share(vllm, None, 4)  # no GPU shared: nothing to check
    check_engine_share(load_config(GENERALIZE, ["rollout.engine=hf"]), 0.2125, 4)
    with pytest.raises(
        ConfigError, match=r"gpu_memory_utilization=0.5 with --jobs 4 .* set rollout.vllm.gpu_memory_utilization=0.106"
    ):
        check_engine_share(vllm, 0.2125, 4)
    check_engine_share(
        load_config(GENERALIZE, ["rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.1"]), 0.2125, 4
    )
