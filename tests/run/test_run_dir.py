"""One run per run directory (run/run_dir.py): the lock, and fresh start vs resume vs overwrite."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import psutil
import pytest

from pacs_megatron.run.checkpoint import MARKER
from pacs_megatron.run.run_dir import LOCK, RunDir, RunDirError


def _lock(path, host, pid, start):
    path.mkdir(parents=True, exist_ok=True)
    (path / LOCK).write_text(json.dumps({"host": host, "pid": pid, "start_time": start, "command": "train"}))


def _checkpoint(run, step):
    d = run / "checkpoints" / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / MARKER).write_text("{}")
    return d


@pytest.mark.subprocess
def test_second_launch_refused_naming_the_running_one_and_stale_locks_taken_over(tmp_path):
    run = tmp_path / "run"
    first = RunDir(run, resume="never")
    first.claim()
    held = json.loads((run / LOCK).read_text())
    assert held["host"] == socket.gethostname() and held["pid"] == psutil.Process().pid
    # A live holder that is another process: refused at once, naming host, pid and start time.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock(run, socket.gethostname(), live.pid, psutil.Process(live.pid).create_time())
        named = rf"in use by another run \(host {socket.gethostname()}, pid {live.pid}, start "
        with pytest.raises(RunDirError, match=named):
            RunDir(run).claim()
        assert "in use by another run" in RunDir(run).problem()
    finally:
        live.kill()
        live.wait()
    # The same pid is dead now (kill -9): stale, taken over.
    assert RunDir(run).problem() is None
    second = RunDir(run)
    second.claim()
    assert json.loads((run / LOCK).read_text())["pid"] == psutil.Process().pid
    second.release()
    assert not (run / LOCK).exists()
    # A live pid that is not the holder (reused pid: another start time) is stale too.
    _lock(run, socket.gethostname(), psutil.Process().pid, 1.0)
    assert RunDir(run).lock_problem() is None
    # Another host: cannot tell; the message says how to clear it.
    _lock(run, "some-other-node", 1234, 1.0)
    with pytest.raises(RunDirError, match=r"another host \(host some-other-node, pid 1234.*delete .*\.lock"):
        RunDir(run).claim()


def test_a_requeued_job_takes_over_its_own_lock_from_another_host(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text(json.dumps({"host": "node7", "pid": 99, "start_time": 1.0, "job": "slurm:123"}))
    monkeypatch.setenv("SLURM_JOB_ID", "456")
    assert "another host" in RunDir(run).problem()  # another job: cannot tell, refused
    monkeypatch.setenv("SLURM_JOB_ID", "123")  # the same job, requeued onto another node
    d = RunDir(run)
    d.claim()
    assert json.loads((run / LOCK).read_text())["job"] == "slurm:123"
    d.release()
    (run / LOCK).write_text("")  # a launch killed between creating and writing its lock
    assert RunDir(run).problem() is None


def test_fresh_start_never_mixes_two_runs(tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    _checkpoint(run, 8)
    assert RunDir(run, resume="auto").problem() is None  # a resume of that run
    msg = RunDir(run, resume="never").problem()
    assert "already holds a run" in msg and "--resume never --overwrite" in msg and "checkpoints up to step 8" in msg
    with pytest.raises(RunDirError, match="--resume never --overwrite"):
        RunDir(run, resume="never").claim()
    assert not (run / LOCK).exists()  # a refused claim leaves no lock behind
    d = RunDir(run, resume="never", overwrite=True, keep=(run / "model",))
    d.claim()
    old = list(tmp_path.glob("run.old-*"))
    assert len(old) == 1 and (old[0] / "metrics.jsonl").is_file()
    assert (old[0] / "checkpoints" / "step_00000008").is_dir()
    assert sorted(p.name for p in run.iterdir()) == [LOCK, "model"]  # the model dir stays; nothing of the old run
    d.release()
    # Auto with no checkpoint: the same run restarted from step 0, not refused.
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert RunDir(run, resume="auto").problem() is None


def test_resume_from_an_older_checkpoint_moves_newer_ones_only_with_overwrite(tmp_path):
    run = tmp_path / "run"
    four = _checkpoint(run, 4)
    _checkpoint(run, 8)
    assert "newest checkpoint step 8" in RunDir(run, resume=str(four)).problem()
    d = RunDir(run, resume=str(four), overwrite=True)
    d.claim()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004", "superseded_step_00000008"]
    d.release()


def test_the_cpu_defaults_keep_their_tiny_model_inside_their_run_dir(tmp_path):
    from pathlib import Path

    from pacs_megatron.config import load_config

    configs = Path(__file__).resolve().parents[2] / "examples" / "configs"
    for name in ("cpu_tiny.yaml", "cpu_generalize.yaml"):
        cfg = load_config(configs / name, [f"trainer.output_dir={tmp_path}/other"])
        assert cfg.model.path == f"{tmp_path}/other/model", name  # another output dir: another tiny model
