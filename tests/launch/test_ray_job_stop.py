"""``ray job stop`` of a ``launcher.kind=ray`` run on a real Ray job server (the dashboard of ``ray[default]``).

A Ray head with its dashboard on 127.0.0.1 (``ray.cluster_utils.Cluster``, so shutting it down stops
only its own processes, never another job's Ray) takes a job submission of the CPU default (TP=1:
one rank actor) with ``RAY_JOB_STOP_WAIT_TIME_S=120`` in its runtime env. Once steps are logged,
the ``ray job stop`` CLI makes Ray's job supervisor SIGTERM the driver, which forwards it to the
ranks: they checkpoint the step they reached and exit, and the job ends STOPPED. A second
submission, with Ray's default 3 s wait, logs the warning at start and resumes from that checkpoint
(its first new step is the next one). No periodic checkpoint (``save_freq=0``): the only checkpoint
is the stop's. The first submission, with a long enough wait, does not warn. With no wait at all
(0 s), Ray SIGKILLs the driver and the trainer rank dies with it: the job is STOPPED, no rank is left.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _launch_helpers import gone_within, wait_until
from _runs import files_under, metrics_rows, train_cmd

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SMALL = [
    "trainer.train_batch_size=10",
    "rollout.n=4",
    "algorithm.micro_batch_size=20",
    "trainer.sft_warmup_steps=1",
    "trainer.test_freq=0",
    "trainer.save_freq=0",  # the stop's checkpoint is the only one
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "parallel.tp=1",  # one rank actor: the stop path is the driver's, and start-up dominates the test
]
WARNING = "RAY_JOB_STOP_WAIT_TIME_S=3: `ray job stop` kills the ranks"


@pytest.fixture(scope="module")
def job_server():
    """A one-node Ray cluster with the job server on its own ports; stopped (its processes only) at the end."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401 - what the job server imports
    except ImportError as e:
        pytest.skip(f"the Ray job server needs `pip install -e .[ray-jobs]` (ray[default]): {e}")
    from _ray_cluster import node_args, start_cluster

    # 1 CPU: the rank's bundle; the job supervisor takes none
    head = node_args(head=True) | {"include_dashboard": True, "dashboard_host": "127.0.0.1"}
    cluster = start_cluster(head)
    try:
        yield f"http://127.0.0.1:{head['dashboard_port']}"
    finally:
        cluster.shutdown()


@pytest.fixture
def client(job_server):
    """A job client. A job the test leaves running is stopped at its end: the cluster has one CPU, and a
    failed test's job held it, so the next test's job waited for a placement it could not get (2026-11-26)."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(job_server)
    yield client
    for job in client.list_jobs():
        if not job.status.is_terminal():
            client.stop_job(job.submission_id)
            wait_until(lambda j=job.submission_id: client.get_job_status(j).is_terminal(), 60, "a left-over job's stop")


def _entrypoint(out: Path, steps: int) -> str:
    # launcher.ray_address=auto: the driver joins the job's cluster ($RAY_ADDRESS, set by the supervisor)
    argv = train_cmd(out, steps, *SMALL, "launcher.kind=ray", "launcher.ray_address=auto")
    return shlex.join(argv)


def _ray_cli(address: str, *args: str) -> subprocess.CompletedProcess:
    ray = os.path.join(os.path.dirname(sys.executable), "ray")  # the venv's console script
    return subprocess.run(
        [ray, "job", *args, "--address", address], capture_output=True, text=True, timeout=200, check=False
    )


def _progress(client, job: str, out: Path):
    """What moves while a job starts and runs: its log (the driver's lines, then its rank's) and the run's files."""
    return len(client.get_job_logs(job)), files_under(out)


def _wait_status(client, job: str, timeout: float, out: Path | None = None) -> str:
    """The job's terminal status. With ``out`` (a job that starts a run), ``timeout`` is the longest stretch
    without progress (``wait_until``); without, the whole wait (a stop)."""
    progress = (lambda: _progress(client, job, out)) if out else None
    done = lambda: client.get_job_status(job).is_terminal()  # noqa: E731
    try:
        wait_until(done, timeout, f"job {job} to end", progress=progress)
    except AssertionError as e:
        raise AssertionError(f"{e}: still {client.get_job_status(job)}:\n{client.get_job_logs(job)[-4000:]}") from None
    return str(client.get_job_status(job).value)


def _checkpoints(out: Path) -> list[int]:
    return sorted(int(d.name.split("_")[1]) for d in (out / "checkpoints").glob("step_*") if (d / "COMPLETE").is_file())


def _start(client, out: Path, env: dict[str, str], steps: int) -> str:
    """Submit a 1000-step run and return its job id once ``steps`` steps are logged."""
    job = client.submit_job(entrypoint=_entrypoint(out, 1000), runtime_env={"env_vars": env | {"OMP_NUM_THREADS": "1"}})
    alive = lambda: not client.get_job_status(job).is_terminal()  # noqa: E731
    progress = lambda: _progress(client, job, out)  # noqa: E731
    try:
        wait_until(lambda: len(metrics_rows(out)) >= steps, 240, f"{steps} logged steps", alive, progress)
    except AssertionError as e:
        raise AssertionError(f"{e}:\n{client.get_job_logs(job)[-4000:]}") from None
    return job


def test_ray_job_stop_checkpoints_and_resubmission_resumes(job_server, client, tmp_path):
    out = tmp_path / "run"
    started = time.monotonic()
    job = _start(client, out, {"RAY_JOB_STOP_WAIT_TIME_S": "120"}, steps=2)
    reached = max(metrics_rows(out))
    stop_asked = time.monotonic()
    res = _ray_cli(job_server, "stop", job)  # waits until the job is terminal
    stop_s = time.monotonic() - stop_asked
    logs = client.get_job_logs(job)
    (tmp_path / "job1.log").write_text(logs)  # kept by pytest for a look after a failure
    assert res.returncode == 0, res.stdout + res.stderr
    assert _wait_status(client, job, 60) == "STOPPED", logs[-4000:]
    assert WARNING not in logs  # 120 s is enough: no warning
    assert "forwarding SIGTERM to 1 ranks" in logs, logs[-4000:]  # the supervisor's SIGTERM reached the driver
    # The step in flight when the signal came is finished, then checkpointed: never an earlier one.
    rows = metrics_rows(out)
    last = max(rows)
    assert sorted(rows) == list(range(1, last + 1)) and last >= reached, sorted(rows)
    assert _checkpoints(out) == [last], (_checkpoints(out), last)
    assert stop_s < 110, f"the stop took {stop_s:.0f}s: Ray's SIGKILL (120 s) may have cut the checkpoint"
    first_s = time.monotonic() - started

    # Resubmitted with Ray's default wait: warned at start, resumes from the stop's checkpoint.
    job2 = client.submit_job(entrypoint=_entrypoint(out, last + 1), runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    status = _wait_status(client, job2, 240, out)
    logs2 = client.get_job_logs(job2)
    (tmp_path / "job2.log").write_text(logs2)
    assert status == "SUCCEEDED", logs2[-4000:]
    assert WARNING in logs2, logs2[-4000:]
    assert f"(step {last})" in logs2, logs2[-4000:]  # "resumed from ... (step N)"
    assert sorted(metrics_rows(out)) == list(range(1, last + 2))  # exactly the next step, once
    sys.stderr.write(
        f"first job (start, {last} steps, stop) {first_s:.0f}s, of which ray job stop {stop_s:.1f}s; "
        f"resumed job {time.monotonic() - started - first_s:.0f}s\n"
    )


def test_ray_job_stop_past_the_wait_kills_driver_and_ranks(client, tmp_path):
    """``RAY_JOB_STOP_WAIT_TIME_S=0``: Ray SIGKILLs the driver right after its SIGTERM. Ray then ends
    the job's actors, and each trainer rank dies with its actor: nothing is left waiting in a
    collective (whether a checkpoint got written is a race at 0 s, so it is not asserted)."""
    out = tmp_path / "run"
    job = _start(client, out, {"RAY_JOB_STOP_WAIT_TIME_S": "0"}, steps=1)
    rank_pid = json.loads((out / "launch.json").read_text())["ranks"][0]["pid"]
    stop_asked = time.monotonic()
    assert client.stop_job(job)
    status = _wait_status(client, job, 60)
    logs = client.get_job_logs(job)
    assert status == "STOPPED", logs[-4000:]
    assert "RAY_JOB_STOP_WAIT_TIME_S=0: `ray job stop` kills the ranks" in logs, logs[-4000:]  # warned at start
    assert gone_within(rank_pid, 30), "the trainer rank outlived the SIGKILLed driver"
    sys.stderr.write(f"stop with a 0 s wait: job STOPPED and rank gone {time.monotonic() - stop_asked:.1f}s after\n")
