"""The waits of the end-to-end tests: a run that keeps moving is waited for, a silent one fails at its stall limit.
(Their limits count from the last sign of life, so a loaded machine slows them without failing them.)"""

import sys
import time

import pytest
from _runs import run_watched, wait_until

TICKS = "import sys, time\nfor i in range({n}):\n    print(i, flush=True); time.sleep(0.5)\n"


@pytest.mark.subprocess
def test_run_watched_waits_for_a_run_that_keeps_moving_and_returns_its_output(tmp_path):
    run = run_watched([sys.executable, "-c", TICKS.format(n=8)], tmp_path, stall=2)  # 4 s in all, never 2 s silent
    assert run.returncode == 0 and run.stdout.split() == [str(i) for i in range(8)]


@pytest.mark.subprocess
def test_run_watched_fails_a_silent_run_at_its_stall_limit(tmp_path):
    start = time.monotonic()
    script = "import sys, time\nprint('started', flush=True)\ntime.sleep(60)\n"
    with pytest.raises(AssertionError, match=r"(?s)[23]s without progress:.*started"):
        run_watched([sys.executable, "-c", script], tmp_path, stall=2)
    assert time.monotonic() - start < 30


@pytest.mark.subprocess
def test_run_watched_counts_files_under_out_as_progress(tmp_path):
    script = (
        "import pathlib, time\nfor i in range(6):\n    pathlib.Path({d!r}, str(i)).write_text('x'); time.sleep(0.5)\n"
    )
    assert run_watched([sys.executable, "-c", script.format(d=str(tmp_path))], tmp_path, stall=2).returncode == 0


def test_wait_until_limit_is_the_stall_with_progress_and_the_total_without():
    start = time.monotonic()
    clock = lambda: int((time.monotonic() - start) / 0.3)  # noqa: E731 - changes every 0.3 s
    assert wait_until(lambda: time.monotonic() - start > 2, 1, "2 s", progress=clock) > 2
    with pytest.raises(AssertionError, match="timed out after 1s waiting for 2 s$"):
        wait_until(lambda: time.monotonic() - start > 10, 1, "2 s")
    with pytest.raises(AssertionError, match="without progress"):
        wait_until(lambda: False, 1, "nothing", progress=lambda: 0)
    with pytest.raises(AssertionError, match="timed out after 2s"):  # the cap bounds a run that moves forever
        wait_until(lambda: False, 1, "forever", progress=clock, cap=2)
