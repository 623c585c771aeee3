"""Graceful stop (utils/preemption.py) and the srun environment mapping (launch/slurm.py).

Unit checks of the time budget and the Ctrl-C rules in plain processes, then one end-to-end run of
the CPU default through the local spawner: Ctrl-C as a terminal sends it (SIGINT to the foreground
process group; the spawner forwards it to the ranks, which run in their own sessions) checkpoints
after the step and exits 130 with no KeyboardInterrupt traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from _runs import gone_within, wait_until

from pacs_megatron.config import ConfigError
from pacs_megatron.launch.slurm import EXIT_REQUEUE, apply_srun_env, plan, srun_exit_code
from pacs_megatron.utils.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, NOT_SAVED, PreemptionFlag

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "cpu_tiny.yaml"


def _budget(**kw) -> SimpleNamespace:
    return SimpleNamespace(**({"stop_after_s": 0.0, "deadline_unix": 0.0, "stop_margin_s": 0.0} | kw))


def test_time_budget_stops_before_the_next_step_would_overrun():
    flag = PreemptionFlag(_budget(stop_after_s=1.0))
    assert not flag.should_stop() and flag.exit_code == 0  # ~0 s in, steps take ~0 s
    time.sleep(0.6)  # a 0.6 s "step": 0.6 + 0.6 > 1.0, another would not fit
    assert flag.should_stop() and flag.exit_code == EXIT_PREEMPTED

    # an absolute deadline (the Slurm job's end) with a margin that already covers it
    flag = PreemptionFlag(_budget(deadline_unix=time.time() + 5.0, stop_margin_s=10.0))
    assert flag.should_stop() and flag.exit_code == EXIT_PREEMPTED
    # no budget at all: only signals stop
    flag = PreemptionFlag(_budget())
    time.sleep(0.2)
    assert not flag.should_stop()


_CHILD = textwrap.dedent(
    """
    import sys, time
    from pacs_megatron.utils.preemption import PreemptionFlag
    flag = PreemptionFlag()
    print("ready", flush=True)
    while flag.signum is None:
        time.sleep(0.05)
    print("stop", flag.should_stop(), flag.exit_code, flush=True)
    time.sleep(20)  # a long checkpoint: only a second Ctrl-C ends it early
    """
)


@pytest.mark.subprocess
def test_ctrl_c_twice_stops_at_once_but_a_duplicate_does_not():
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)  # the same Ctrl-C, forwarded by a launcher: ignored
    assert proc.stdout.readline().split() == ["stop", "True", str(EXIT_INTERRUPTED)]
    time.sleep(1.3)  # safe as a fixed time: more than DUPLICATE_S (1 s) after the pair, a minimum, not a wait
    assert proc.poll() is None  # still running: the duplicate did not stop it
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)  # a real second Ctrl-C
    assert proc.wait(timeout=10) == EXIT_INTERRUPTED
    assert time.monotonic() - t0 < 5
    err = proc.stderr.read()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


_NATIVE = textwrap.dedent(
    """
    import subprocess, sys, torch
    from pacs_megatron.utils.preemption import PreemptionFlag, unwind_on_signals
    torch.set_num_threads(1)
    if sys.argv[1] == "train":
        flag = PreemptionFlag()
    elif sys.argv[1] == "command":  # eval, compare
        unwind_on_signals("the evaluation stopped before its results were written")
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # a reward worker, say
    print("ready", helper.pid, flush=True)
    torch.linalg.matrix_power(torch.eye(3000), 2**62)  # 62 GEMMs of 54 GFLOP on one thread: Python handlers wait
    print("returned", flush=True)
    """
)


# (child mode, signal, exit code, the first signal's line, the second's), the second signal to end it
NATIVE_CASES = {
    "train_sigterm": ("train", signal.SIGTERM, EXIT_PREEMPTED, "will checkpoint after the current step", NOT_SAVED),
    "eval_ctrl_c": ("command", signal.SIGINT, EXIT_INTERRUPTED, "stopping", "the evaluation stopped before"),
}


@pytest.mark.subprocess
@pytest.mark.parametrize("case", NATIVE_CASES)
def test_a_second_signal_stops_a_long_native_call_at_once(case):
    """The second signal acts from a helper thread while the main thread is in one long native call (a
    Python signal handler, or eval's KeyboardInterrupt, would wait for it to return): the code at once, one
    line, the helper killed. Trainer ranks (PreemptionFlag) and eval / compare (unwind_on_signals) alike."""
    mode, sig, code, first, second = NATIVE_CASES[case]
    cmd = [sys.executable, "-c", _NATIVE, mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        word, helper = proc.stdout.readline().split()
        assert word == "ready"
        # inside the GEMM: the child's CPU time grows (nothing else runs after "ready"), a wait on that rather
        # than a fixed 0.5 s (eval's first Ctrl-C before the call would unwind at once and end the child)
        child = psutil.Process(proc.pid)
        start = sum(child.cpu_times()[:2])
        wait_until(lambda: sum(child.cpu_times()[:2]) > start + 0.3, 60, "the GEMM", lambda: proc.poll() is None)
        proc.send_signal(sig)
        time.sleep(1.3)  # more than DUPLICATE_S: a second request, not the first one seen twice (a minimum)
        assert proc.poll() is None  # the first waits for the step (or the call) to end
        t0 = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == code
        assert time.monotonic() - t0 < 5
    finally:
        proc.kill()
    out, err = proc.communicate()
    name = signal.Signals(sig).name
    assert "returned" not in out
    assert f"received {name}: {first}" in err, err
    lines = [x for x in err.splitlines() if x.startswith(f"second {name}")]
    assert len(lines) == 1 and lines[0].startswith(f"second {name}: exiting now with code {code}; {second}"), err
    assert gone_within(int(helper), 5.0), "the helper process survived"


def test_srun_env_and_plan(monkeypatch):
    monkeypatch.delenv("PACS_SRUN_RANKS", raising=False)
    assert srun_exit_code(EXIT_PREEMPTED) == EXIT_PREEMPTED  # not under srun: unchanged
    monkeypatch.setenv("PACS_SRUN_RANKS", "1")  # what apply_srun_env records
    assert srun_exit_code(EXIT_PREEMPTED) == EXIT_REQUEUE and srun_exit_code(1) == 1
    env = {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1"}
    env |= {"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "MASTER_PORT": "1234"}
    assert apply_srun_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")
    assert env["PACS_SRUN_RANKS"] == "1"
    assert not apply_srun_env({"RANK": "0", "SLURM_PROCID": "1", "SLURM_STEP_ID": "0"})  # torchrun's ranks
    assert not apply_srun_env({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"})

    assert plan(2, 2, str(CONFIG), [])[0] == "parallel.dp=2"  # 4 ranks / TP=2
    with pytest.raises(ConfigError, match=r"= 3 ranks is not a multiple of parallel.tp \* parallel.pp"):
        plan(3, 1, str(CONFIG), [])
    with pytest.raises(ConfigError, match="drop the parallel.dp override"):
        plan(2, 2, str(CONFIG), ["parallel.dp=1"])


@pytest.mark.slow
@pytest.mark.distributed
def test_ctrl_c_checkpoints_and_exits_130(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pacs_megatron", "train", "--config", str(CONFIG), f"trainer.output_dir={out}"]
    cmd += [f"model.path={out}/model", "trainer.total_steps=200", "trainer.train_batch_size=10", "rollout.n=4"]
    cmd += ["algorithm.micro_batch_size=20", "trainer.sft_warmup_steps=1", "trainer.test_freq=0"]
    cmd += ["logging.progress_bar=false", "logging.tensorboard=false"]
    # Own process group, as a shell job: killpg(SIGINT) is what Ctrl-C in the terminal does.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = out / "metrics.jsonl"
    end = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < end, "the run ended before step 1"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    log, _ = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_INTERRUPTED, log[-3000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    last = len(metrics.read_text().splitlines())
    assert last < 200 and (out / "checkpoints" / f"step_{last:08d}" / "COMPLETE").is_file()
    assert "received SIGINT" in log and "a rank exited" not in log


@pytest.mark.subprocess
def test_a_warning_while_a_finished_rank_exits_does_not_kill_it():
    """A rank whose run is done exits 0 although SIGUSR1 keeps arriving until it is gone: Python resets
    the handlers it installed at shutdown, so without run_rank's ignore the rank died of the signal
    (exit 138; on the local Slurm this failed a job whose run had completed)."""
    script = textwrap.dedent(
        """
        import os, subprocess, sys, time
        from pacs_megatron.launch.rank import run_rank

        def fn():
            from pacs_megatron.utils.preemption import PreemptionFlag
            PreemptionFlag()  # the loop's handler, as train.py installs it
            return 0

        code = run_rank(fn)
        sender = f"while kill -USR1 {os.getpid()} 2>/dev/null; do :; done"  # until this process is reaped
        subprocess.Popen(["bash", "-c", sender], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        sys.exit(code)
        """
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
