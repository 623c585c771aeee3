"""One short real run (2 ranks, the CPU default) checks the run directory's owner and a NaN reward:

- while it runs, a second launch into its directory is refused at once (exit 2, one line naming the
  running rank 0's host and pid): nothing interleaves with it;
- its reward returns NaN: each NaN is a counted reward error scored 0, and ``reward.max_failure_steps``
  stops the run naming ``reward.fn`` (exit 1), instead of skipping every update and ending "complete";
- afterwards the lock is gone, and ``--resume never`` into the old run is refused, naming
  ``--resume never --overwrite``;
- ``--resume never --overwrite`` moves the old run aside whole and starts fresh: here with
  ``trainer.total_steps=0`` after a warm-up (kept as a step-0 checkpoint, not discarded) and
  ``trainer.val_before_train`` (a step-0 validation).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from _runs import REPO, SHORT, metrics_rows, train_cmd

NAN_RUN = [*SHORT, "algorithm.loss=grpo", "reward.fn=reward_user_fns:always_nan", "reward.max_failure_steps=2"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "reward"), env.get("PYTHONPATH", "")])
    return env


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


@pytest.mark.distributed
def test_one_run_per_directory_and_a_nan_reward_stops_the_run(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(
        train_cmd(out, 4, *NAN_RUN), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        end = time.monotonic() + 120
        while not (out / ".lock").is_file() and first.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        holder = json.loads((out / ".lock").read_text())
        os.kill(holder["pid"], signal.SIGSTOP)  # hold the first run still (alive) while the second launches
        try:
            second = subprocess.run(
                train_cmd(out, 4, *NAN_RUN), env=_env(), capture_output=True, text=True, timeout=120
            )
        finally:
            os.kill(holder["pid"], signal.SIGCONT)
        log, _ = first.communicate(timeout=300)
    finally:
        first.kill()
    lines = _lines(second.stdout + second.stderr)
    assert second.returncode == 2 and len(lines) == 1, lines
    assert f"in use by another run (host {holder['host']}, pid {holder['pid']}, start " in lines[0]

    assert first.returncode == 1, log[-3000:]
    assert "reward.fn='reward_user_fns:always_nan' failed on every response for 2 consecutive steps" in log
    assert "returned nan: a reward must be finite" in log
    assert "run complete" not in log and "Traceback" not in log
    rows = metrics_rows(out)
    assert rows[1]["reward/errors"] == 40.0 and rows[1]["reward/mean"] == 0.0  # 10 prompts x 4, scored 0
    assert not (out / ".lock").exists()  # released by the failed run

    again = subprocess.run(
        [*train_cmd(out, 4, *NAN_RUN), "--resume", "never"], env=_env(), capture_output=True, text=True, timeout=120
    )
    lines = _lines(again.stdout + again.stderr)
    assert again.returncode == 2 and len(lines) == 1 and "--resume never --overwrite" in lines[0], lines

    overrides = [*SHORT, "trainer.test_freq=1", "trainer.val_before_train=true", "trainer.val_n=1", "trainer.val_k=[1]"]
    fresh = subprocess.run(
        [*train_cmd(out, 0, *overrides), "--resume", "never", "--overwrite"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    old = list(tmp_path.glob("run.old-*"))
    assert len(old) == 1 and metrics_rows(old[0])[1]["reward/errors"] == 40.0  # the old run, whole
    assert list(metrics_rows(out)) == [0] and "val/arith/pass@1" in metrics_rows(out)[0]
    final = json.loads((out / "final.json").read_text())
    assert final["last_checkpoint"].endswith("step_00000000") and "None" not in fresh.stderr
