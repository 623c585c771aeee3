"""``examples/slurm/multinode.sbatch`` on a real two-node Slurm (conftest.py: n1, n2 on 127.0.0.1).

- a real time limit: a 2-node job (TP=2 spanning the nodes) of 300 steps submitted with ``--time=2
  --signal=B:USR1@100``. The controller sends the warning ~20 s in, mid-run (or while the ranks still
  load: the early handler records it, they stop after their first step): the ranks checkpoint, well
  before the limit, rank 0 writes the requeue marker, the script requeues from it; the requeued run,
  given a 30-minute limit, resumes and completes. Each step is logged exactly once in metrics.jsonl
  and rollouts.jsonl, the job never reaches TIMEOUT. This run is also the plain 2-node completion
  check. The 300 steps are the first run's length only: while the requeued job waits to restart, the
  test rewrites its config file to end 3 steps past the stop (a resume may change total_steps), so the
  requeued run trains 3 steps, not the ~260 left (issue 59: ~90 s of the suite).
- a warning that reaches the batch shell before its handlers exist: recorded, forwarded once the rank
  step exists, and the job is requeued (it used to kill the shell: the job FAILED).
- a user's ``scancel JOB``: the ranks checkpoint within KillWait, the job ends CANCELLED and is not
  requeued.
- a rank that dies (SIGKILL) fails the job within seconds.
- 2 tasks per node x 2 nodes: ``doctor --distributed`` under plain srun (no MASTER_ADDR / MASTER_PORT
  given: they come from scontrol and the job id), SLURM_LOCALID 1, "2(x2)" task counts.
- bad input: no --config, and a world size that does not fit tp * pp: one line, exit 2, no srun.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _launch_helpers import CONFIG, REPO, files_under, short_run, steps_of, wait_until

from pacs_megatron.utils.dist import free_port

SCRIPT = REPO / "examples" / "slurm" / "multinode.sbatch"
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(slurm):
    """A test that fails with its job still running must not fail the next ones (their jobs would
    wait behind it for the two nodes)."""
    yield
    slurm.cancel_jobs()


def _submit(slurm, work: Path, *args: str, nodes: int = 2, env: dict | None = None, sbatch: tuple = ()) -> str:
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **slurm.env,
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "MASTER_PORT": str(free_port()),
        **(env or {}),
    }
    out = subprocess.run(
        ["sbatch", "--parsable", "--nodes", str(nodes), *sbatch, str(SCRIPT), *args],
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


def _write_config(path: Path, total_steps: int) -> None:
    """The CPU default's config with ``trainer.total_steps`` set to ``total_steps``."""
    text, n = re.subn(r"^(  total_steps:) \d+", rf"\1 {total_steps}", CONFIG.read_text(), flags=re.M)
    assert n == 1, "cpu_tiny.yaml's trainer.total_steps line not found"
    path.write_text(text)


def test_sbatch_real_time_limit_checkpoints_requeues_and_completes(slurm, tmp_path):
    # A run several times longer than the warning's delay, so that the warning lands in the middle of
    # it whatever the machine's load (an unloaded run of a few steps finishes before the controller
    # sends it). Each run stops at its warning, checkpoints and is requeued from rank 0's marker; the
    # early (start-up) handler has its own deterministic test (test_slurm_env.py).
    out, steps = tmp_path / "run", 300
    # total_steps is the config file's (not an override on the script's command line, which a requeue repeats),
    # so that the requeued run can be given fewer steps than the first run's 300 (below)
    config = tmp_path / "config.yaml"
    _write_config(config, steps)
    overrides = [
        o for o in short_run(out, steps, "trainer.stop_margin_s=5") if not o.startswith("trainer.total_steps=")
    ]
    # The warning 100 s before a 120 s limit (the controller sends it at its next periodic check).
    limit = ("--time=2", "--signal=B:USR1@100")
    job = _submit(slurm, tmp_path, "--config", str(config), *overrides, sbatch=limit)
    states, now = set(), {}

    def poll() -> dict[str, str]:
        """JobState and Restarts from one ``scontrol show job`` (a poll was two processes, one a field)."""
        now.clear()
        for key, _, value in (tok.partition("=") for tok in slurm.run("scontrol", "show", "job", "-o", job).split()):
            now.setdefault(key, value)  # the first of a key, as job_field reads it
        states.add(now["JobState"])
        return now

    def running() -> bool:  # the state the last poll saw
        return not states & {"TIMEOUT", "FAILED", "CANCELLED"}

    wait_until(lambda: poll()["Restarts"] != "0", 240, "the first requeue", running)
    log = _log(tmp_path, job)
    assert "requeueing job" in log, log[-3000:]
    first = [ln for ln in log.splitlines() if "requeueing job" in ln][0]
    assert '"reason": "SIGUSR1"' in first, first
    stopped = json.loads(first[first.index("{") : first.index("}") + 1])["step"]
    assert 1 <= stopped < steps, first  # stopped by the warning, not killed, before the end
    assert (out / "checkpoints" / f"step_{stopped:08d}" / "COMPLETE").is_file()

    # The requeued run resumes at `stopped` and trains 3 steps: its config (read when it starts) now ends there.
    # It was the ~260 steps left of 300, ~90 s of steps that proved nothing the first 3 do not.
    total = stopped + 3
    _write_config(config, total)
    # The requeued run gets room to finish. With the same 2-minute limit it would be warned 20 s in
    # again, and on a loaded machine the ranks take longer than that to start (25 s at a load average
    # of ~30 on 2 cores): each run then does one step, and 300 steps take 300 requeues (seen).
    slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=30")
    # A requeued job is held (BeginTime) until the first run's job credential expires: 120 s by default,
    # 10 s in this cluster (AuthInfo cred_expire). Releasing it earlier with `scontrol update
    # StartTime=now` races that expiry: slurmd refuses it ("Job credential revoked") and the job FAILS.
    end = time.monotonic() + 600
    while poll()["JobState"] not in DONE and time.monotonic() < end:
        time.sleep(1)
    state = _finished(slurm, tmp_path, job, 5)
    log = _log(tmp_path, job)
    assert state == "COMPLETED", log[-4000:] + slurm.logs()
    assert "TIMEOUT" not in states, states  # every run stopped before its limit
    assert "restart 1" in log and "2 node(s) x 1" in log
    assert f"forwarding it to step {job}.0;" in log  # the rank step, not the extern step or the whole job
    requeues = [ln for ln in log.splitlines() if "requeueing job" in ln]
    assert all('"reason": "SIGUSR1"' in ln for ln in requeues), requeues
    # one requeue per stopped run, none after the last step
    assert slurm.job_field(job, "Restarts") == str(len(requeues)), requeues
    assert "trainer.deadline_unix=" in log  # the job's end time reached the trainer's budget
    assert f"trainer.total_steps: {steps} -> {total}" in log, log[-4000:]  # the rewrite came before the restart
    assert steps_of(out / "metrics.jsonl") == list(range(1, total + 1))
    # rollouts.jsonl: trainer.log_rollouts=1 row per step, none replayed
    assert steps_of(out / "rollouts.jsonl") == list(range(1, total + 1))
    assert (out / "checkpoints" / f"step_{total:08d}" / "COMPLETE").is_file()
    assert "DUE TO TIME LIMIT" not in (tmp_path / f"slurm-pacs-{job}.out").read_text()  # slurmstepd's own line


def test_sbatch_warning_before_the_shell_has_its_handlers_requeues(slurm, tmp_path):
    # The controller once sent the time-limit warning 2.5 s into a requeued run, before the script had
    # installed its USR1 trap: the shell died of it and the job FAILED. Make that window wide and
    # certain (the plan step sleeps 8 s first) and send the warning to the batch shell alone inside it.
    out = tmp_path / "run"
    slow, in_plan = tmp_path / "python", tmp_path / "in_plan"
    plan = f'[[ "$2" == pacs_megatron.launch.slurm ]] && {{ touch "{in_plan}"; sleep 8; }}'
    slow.write_text(f'#!/bin/bash\n{plan}\nexec {sys.executable} "$@"\n')
    slow.chmod(0o755)
    job = _submit(slurm, tmp_path, "--config", str(CONFIG), *short_run(out, 500), env={"PYTHON": str(slow)})
    # the plan step has begun its sleep (a wait on that, not a fixed second after the shell's log appeared)
    wait_until(in_plan.exists, 60, "the plan's sleep", lambda: slurm.job_field(job, "JobState") != "FAILED")
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    wait_until(
        lambda: slurm.job_field(job, "Restarts") != "0",
        240,
        "the requeue",
        lambda: slurm.job_field(job, "JobState") not in DONE,
    )
    log = _log(tmp_path, job)
    slurm.run("scancel", job)
    assert "batch shell got SIGUSR1" in log, log[-3000:]
    requeue = [ln for ln in log.splitlines() if "requeueing job" in ln]
    assert requeue and '"reason": "SIGUSR1"' in requeue[0], log[-3000:]
    step = json.loads(requeue[0][requeue[0].index("{") : requeue[0].index("}") + 1])["step"]
    assert (out / "checkpoints" / f"step_{step:08d}" / "COMPLETE").is_file()


def test_sbatch_scancel_cancels_without_requeue(slurm, tmp_path):
    out = tmp_path / "run"
    job = _submit(slurm, tmp_path, "--config", str(CONFIG), *short_run(out, 500))
    running = lambda: slurm.job_field(job, "JobState") in ("PENDING", "RUNNING")  # noqa: E731
    wait_until(lambda: 1 in steps_of(out / "metrics.jsonl"), 240, "step 1", running, lambda: files_under(tmp_path))
    slurm.run("scancel", job)  # SIGTERM to every step and the batch shell, as a user does
    assert _finished(slurm, tmp_path, job, 60) == "CANCELLED"
    # Not a wait for a condition but a window to see that nothing happens: a requeue would show here (the old TERM
    # trap requeued the completing job at once; the controller polls every second), and no event says "none came"
    time.sleep(3)
    assert slurm.job_field(job, "JobState") == "CANCELLED" and slurm.job_field(job, "Restarts") == "0"
    log = _log(tmp_path, job)
    assert "batch shell got SIGTERM" in log and "requeueing" not in log, log[-3000:]
    assert not (tmp_path / "logs" / f".requeue-{job}").exists()
    # the ranks had the time (KillWait=30 here) to checkpoint the step they were in
    assert (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step_*/COMPLETE")), log[-3000:]


def test_srun_two_tasks_per_node_doctor_distributed(slurm, tmp_path):
    launcher = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    env = {k: v for k, v in slurm.env.items() if k not in launcher}  # srun's tasks get theirs from Slurm
    env |= {"OMP_NUM_THREADS": "1"}
    cmd = f"srun {sys.executable} -m pacs_megatron doctor --distributed --dir {tmp_path}/shared"
    res = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes",
            "2",
            "--ntasks-per-node",
            "2",
            "--output",
            f"{tmp_path}/out.txt",
            "--wrap",
            cmd,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job = res.stdout.strip().split(";")[0]
    state = slurm.wait_job(job, DONE, 120)
    text = (tmp_path / "out.txt").read_text()
    assert state == "COMPLETED", text[-3000:]
    # MASTER_ADDR: n1's NodeAddr (scontrol), the port from the job id, below the ephemeral range
    assert f"launcher slurm, world 4, master 127.0.0.1:{10000 + int(job) % 20000}" in text, text
    for rank, node, local in ((0, "n1", 0), (1, "n1", 1), (2, "n2", 0), (3, "n2", 1)):
        assert f"rank {rank:<3} local {local}/2  node {node}  " in text, text
    assert f"shared {tmp_path}/shared: ok" in text and "gloo all-reduce" in text and "ERROR" not in text, text


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
    wait_until(lambda: 1 in steps_of(out / "metrics.jsonl"), 240, "step 1", running, lambda: files_under(tmp_path))
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
