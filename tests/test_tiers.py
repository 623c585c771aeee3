"""tests/_tiers.py: an unmarked test that starts a process fails and names the marker; a marked one passes."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from types import SimpleNamespace

import _tiers
import pytest


class _Item:
    def __init__(self, nodeid: str, marks: tuple[str, ...]) -> None:
        self.nodeid, self._marks = nodeid, marks

    def get_closest_marker(self, name: str):
        return name if name in self._marks else None


def _run_as(item, start) -> SimpleNamespace:
    """``start()`` as if ``item`` were running, then its call report through the guard."""
    real = _tiers._current[0]
    _tiers.set_current(item)
    try:
        start()
    finally:
        _tiers.set_current(real)
    report = SimpleNamespace(passed=True, outcome="passed", longrepr=None)
    _tiers.violation_report(item, report)
    return report


@pytest.mark.subprocess
@pytest.mark.parametrize("door", ["popen", "multiprocessing"])
def test_an_unmarked_test_that_starts_a_process_fails_with_the_fix(door):
    def start():
        if door == "popen":
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        else:
            p = multiprocessing.get_context("spawn").Process(target=int)
            p.start()
            p.join()

    report = _run_as(_Item("t.py::unmarked", ()), start)
    assert report.outcome == "failed" and "@pytest.mark.distributed" in report.longrepr
    assert _tiers.launches.pop("t.py::unmarked") == 1  # counted once (a Process.start's own Popen is the same)
    for mark in ("slow", "distributed", "subprocess"):
        assert _run_as(_Item(f"t.py::{mark}", (mark,)), start).outcome == "passed"
        _tiers.launches.pop(f"t.py::{mark}")  # the stand-ins' launches are not the suite's (its cost report)
    assert _run_as(_Item("t.py::quiet", ()), lambda: None).outcome == "passed"  # no process, no marker needed


def test_a_library_probe_of_the_machine_needs_no_marker():
    """matplotlib's first plot on a machine builds its font cache with ``fc-list``: on a fresh machine the fast
    tier's first plotting test (tests/tools/compare/test_report.py) failed the guard, and passed on a rerun."""

    def start():
        try:
            subprocess.run(["fc-list", "--help"], capture_output=True, check=False)
        except OSError:  # no fontconfig here: matplotlib catches the same
            pass

    assert _run_as(_Item("t.py::plots", ()), start).outcome == "passed"
    assert "t.py::plots" not in _tiers.launches  # a probe is no launch of the suite's


def test_the_cost_report_sums_each_files_phases_and_launches():
    """The by-file table of the suite's report (tests/_tiers.py, printed by tests/conftest.py): a file's setup,
    call and teardown seconds and its tests' launches add up, costliest file first."""
    durations = [(2.0, "call", "tests/a.py::t"), (1.0, "setup", "tests/a.py::t"), (0.5, "call", "tests/a.py::u")]
    durations.append((9.0, "call", "tests/b.py::t[x]"))
    table = _tiers.per_file_table(durations, {"tests/a.py::t": 3, "tests/b.py::t[x]": 1, "elsewhere": 4})
    assert table[2:] == ["| 9.0 | 1 | 1 | `tests/b.py` |", "| 3.5 | 2 | 3 | `tests/a.py` |"]
