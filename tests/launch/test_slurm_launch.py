"""``examples/slurm/multinode.sbatch`` on a real two-node Slurm (conftest.py: n1, n2 on 127.0.0.1).

- pre-emption: a 2-node job (TP=2 spanning the nodes) gets ``scancel --batch --signal=USR1``
  mid-run, as ``--signal=B:USR1@N`` would deliver it: every rank checkpoints after its step, the
  script requeues the job, the requeued job resumes and completes; each step is logged exactly once
  in metrics.jsonl and rollouts.jsonl. This run is also the plain 2-node completion check.
- a rank that dies (SIGKILL) fails the job within seconds.
- bad input: no --config, and a world size that does not fit tp * pp: one line, exit 2, no srun.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _launch_helpers import CONFIG, REPO, short_run, steps_of, wait_until

from pacs_megatron.utils.dist import free_port

SCRIPT = REPO / "examples" / "slurm" / "multinode.sbatch"
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _submit(slurm, work: Path, *args: str, nodes: int = 2, env: dict | None = None, time_min: int = 0) -> str:
    work.mkdir(parents=True, exist_ok=True)
    env = dict(slurm.env, PYTHON=sys.executable, MASTER_PORT=str(free_port()), **(env or {}))
    limit = ["--time", str(time_min)] if time_min else []
    out = subprocess.run(
        ["sbatch", "--parsable", "--nodes", str(nodes), *limit, str(SCRIPT), *args],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def _log(work: Path, job: str) -> str:
    path = work / "logs" / f"pacs-{job}.out"
    return path.read_text() if path.exists() else ""


def _finished(slurm, work: Path, job: str, timeout: float) -> str:
    try:
        return slurm.wait_job(job, DONE, timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_log(work, job)[-4000:]}") from None


def test_sbatch_two_nodes_preempt_requeue_resume(slurm, tmp_path):
    out, steps = tmp_path / "run", 25
    job = _submit(slurm, tmp_path, "--config", str(CONFIG), *short_run(out, steps), time_min=30)
    running = lambda: slurm.job_field(job, "JobState") in ("PENDING", "RUNNING")  # noqa: E731
    wait_until(lambda: 2 in steps_of(out / "metrics.jsonl"), 240, "step 2", running)
    assert slurm.job_field(job, "NodeList") == "n[1-2]"  # TP=2: rank 0 on n1, rank 1 on n2

    # What --signal=B:USR1@N does near the time limit: USR1 to the batch shell only.
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    wait_until(lambda: slurm.job_field(job, "Restarts") == "1", 120, "the requeue", lambda: True)
    log = _log(tmp_path, job)
    assert "batch shell got SIGUSR1" in log and "requeueing job" in log, log[-3000:]
    stopped = max(steps_of(out / "metrics.jsonl"))
    assert stopped < steps, "the signal came too late to test a resume"
    assert (out / "checkpoints" / f"step_{stopped:08d}" / "COMPLETE").is_file()

    # A requeued job is held (BeginTime) until the first run's job credential expires: 120 s by default,
    # 10 s in this cluster (AuthInfo cred_expire). Releasing it earlier with `scontrol update
    # StartTime=now` races that expiry: slurmd refuses it ("Job credential revoked") and the job FAILS.
    state = _finished(slurm, tmp_path, job, 240)
    log = _log(tmp_path, job)
    assert state == "COMPLETED", log[-4000:] + slurm.logs()
    assert "restart 1" in log and "2 node(s) x 1" in log
    assert "trainer.deadline_unix=" in log  # the job's end time (--time 30) reached the trainer's budget
    assert steps_of(out / "metrics.jsonl") == list(range(1, steps + 1))
    # rollouts.jsonl: trainer.log_rollouts=1 row per step, none replayed
    assert steps_of(out / "rollouts.jsonl") == list(range(1, steps + 1))
    assert (out / "checkpoints" / f"step_{steps:08d}" / "COMPLETE").is_file()


def _rank_pid(job: str, rank: int) -> int | None:
    """PID of the trainer process that srun started as task ``rank`` of ``job`` (same machine)."""
    want = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_PROCID={rank}".encode()}
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes()
            env = set((d / "environ").read_bytes().split(b"\0"))
        except (OSError, ValueError):
            continue
        if b"pacs_megatron.launch" in cmd and want <= env:
            return int(d.name)
    return None


def test_sbatch_dead_rank_fails_fast(slurm, tmp_path):
    out = tmp_path / "run"
    job = _submit(slurm, tmp_path, "--config", str(CONFIG), *short_run(out, 500))
    running = lambda: slurm.job_field(job, "JobState") in ("PENDING", "RUNNING")  # noqa: E731
    wait_until(lambda: 1 in steps_of(out / "metrics.jsonl"), 240, "step 1", running)
    pid = _rank_pid(job, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    state = _finished(slurm, tmp_path, job, 60)
    took = time.monotonic() - t0
    assert state == "FAILED", _log(tmp_path, job)[-3000:]
    assert took < 20, f"the job took {took:.0f}s to fail after a rank died"
    assert slurm.job_field(job, "Restarts") == "0"  # a crash is not a pre-emption: no requeue
    assert "requeueing" not in _log(tmp_path, job)


def test_sbatch_bad_input(slurm, tmp_path):
    job = _submit(slurm, tmp_path / "noconfig", "trainer.total_steps=1")
    assert _finished(slurm, tmp_path / "noconfig", job, 60) == "FAILED"
    assert slurm.job_field(job, "ExitCode") == "2:0"
    log = _log(tmp_path / "noconfig", job)
    assert log.startswith("usage: sbatch") and len(log.splitlines()) == 1, log

    # one node x 1 process cannot hold TP=2: one line naming both, before any srun
    job = _submit(slurm, tmp_path / "nofit", "--config", str(CONFIG), nodes=1, env={"NPROC_PER_NODE": "1"})
    assert _finished(slurm, tmp_path / "nofit", job, 60) == "FAILED"
    assert slurm.job_field(job, "ExitCode") == "2:0"
    log = _log(tmp_path / "nofit", job)
    assert "1 node(s) x NPROC_PER_NODE=1" in log and "parallel.tp * parallel.pp" in log, log
    assert "job " not in log  # stopped before the srun line

    # outside Slurm the script says how to submit it
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=slurm.env, timeout=30)
    assert res.returncode == 2 and res.stderr.startswith("usage: sbatch")
