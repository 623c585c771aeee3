"""A second SIGTERM ends ``train`` at once (issue #40 item 3), for real on the CPU default, while the step is
stuck in one long native call (tests/train/slow_reward.py: a reward that runs minutes of GEMMs in one torch
call, in the rank's main thread, where a Python signal handler would wait for it):

(a) one process that is the rank (a 1-rank colocated run, no spawner: what torchrun and srun ranks are, and
    the run of issue #40): the first SIGTERM is announced at once, the second, more than DUPLICATE_S later,
    exits 143 within seconds with one line saying the step was not saved;
(b) the local launcher with a separate engine process (rollout.placement=separate): both signals go to the
    launcher, which kills the rank and the engine itself; same code and line, and no process of the job
    survives.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from _runs import SHORT, train_cmd, wait_for

from pacs_megatron.utils.preemption import DUPLICATE_S, EXIT_PREEMPTED, NOT_SAVED

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
NOW_LINE = f"second SIGTERM: exiting now with code {EXIT_PREEMPTED}; {NOT_SAVED}"


def _stop_twice(tmp_path: Path, name: str, *overrides: str) -> tuple[str, list[psutil.Process]]:
    """Start a run, wait until its step is inside the slow reward, SIGTERM the launched process twice;
    returns its output and the processes of the job as they were before the signals."""
    marker = tmp_path / f"{name}.in_reward"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    env["PACS_SLOW_REWARD_MARKER"] = str(marker)
    cmd = train_cmd(tmp_path / name, 3, *SHORT, "parallel.tp=1", "reward.fn=slow_reward:score", *overrides)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(marker.exists, 600, proc)
        job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        # Not waits on a condition, and safe as fixed times: the first SIGTERM only asks for a checkpoint after
        # the step, whether it lands just before the native call or inside it, so the 0.5 s only makes "inside"
        # the usual case; the second must come more than DUPLICATE_S after the first to count as a second
        # request (utils/preemption.py), a minimum that a loaded machine can only lengthen.
        time.sleep(0.5)
        proc.terminate()
        time.sleep(DUPLICATE_S + 0.5)
        assert proc.poll() is None, "the first SIGTERM must only ask for a checkpoint after the step"
        t0 = time.monotonic()
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 10, f"took {time.monotonic() - t0:.1f}s after the second SIGTERM"
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    return out, job


def _survivors(job: list[psutil.Process], timeout: float = 10.0) -> list[str]:
    end = time.monotonic() + timeout
    while True:
        alive = [p for p in job if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > end:
            return [" ".join(p.cmdline()[:4]) for p in alive]
        time.sleep(0.2)


def test_a_second_sigterm_ends_a_run_stuck_in_a_native_call(tmp_path):
    out, job = _stop_twice(tmp_path, "rank")
    assert "received SIGTERM: will checkpoint after the current step" in out, out[-3000:]
    assert [x.split("] ")[-1] for x in out.splitlines() if "second SIGTERM:" in x] == [NOW_LINE], out[-3000:]
    assert "Traceback" not in out and not _survivors(job)

    out, job = _stop_twice(tmp_path, "launcher", "rollout.placement=separate")
    assert len(job) >= 3, "the launcher, its rank and the engine process"
    assert [x.split("] ")[-1] for x in out.splitlines() if "second SIGTERM:" in x] == [NOW_LINE], out[-3000:]
    assert not _survivors(job), "a rank or engine process survived"
