"""The test tiers' guard: a test that starts a process must say so with a marker.

The fast tier (``make test``: ``pytest -m "not slow and not distributed"``) is the suite without the tests
that spawn ranks, launch training or start an engine. A marker is a promise nobody checks unless something
does, so this module checks it where it can be checked exactly: at run time. ``subprocess.Popen`` and
``multiprocessing``'s ``Process.start`` (what torch's ``mp.spawn``, the local launcher, vLLM, Ray's CLI and the
reward pool all go through) are wrapped once per session; a start during a test's setup, call or teardown
whose item carries none of :data:`SPAWN_MARKS` fails that test, naming the marker to add.

Why at run time and not by reading the test's source at collection: the process is often started three
calls deep (a fixture, a helper in tests/_runs.py, the package's own launcher), where a scan of the test's
text cannot see it. A test that starts a short child on purpose (a fresh interpreter for an import check)
says so with ``@pytest.mark.subprocess`` and stays in the fast tier.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import threading

SPAWN_MARKS = ("slow", "distributed", "subprocess", "gpu")
"""A test with one of these may start processes (``subprocess``: short children, still in the fast tier)."""

PROBES = frozenset(
    {"uname", "lscpu", "ldconfig", "gcc", "g++", "cc", "ld", "objdump", "nvidia-smi", "git", "which", "mount", "umount"}
    | {"fc-list"}
)
"""Commands libraries run to look at the machine (``platform.processor()`` runs ``uname -p``; ctypes'
``find_library`` runs ``ldconfig``; matplotlib's first plot on a machine lists its fonts with ``fc-list`` to build
its font cache; a test mounts a small tmpfs): milliseconds, not a process a test starts."""

_state = threading.local()
_current: list = [None]  # the running item; a list so that threads other than pytest's see it too
_violations: dict[str, str] = {}  # nodeid -> what it started
launches: dict[str, int] = {}
"""nodeid -> the processes this pytest process started during that test (a ``Popen`` or a ``Process.start``,
the Popen inside a Process.start not counted twice; library probes not counted): the suite's launch count,
which the end-of-run report (tests/conftest.py) sums. It counts what the suite's own process starts: the
ranks a launcher starts are the launcher's, one launch here, whatever the world size."""


FAST_TIER_SKIP = ("slow", "distributed", "gpu")
"""Markers that take a test out of the fast tier (``subprocess`` keeps it in)."""
FAIL_FAST_ENV = "PACS_FAIL_FAST_TIER"
"""Set (CI does): the whole suite runs the fast tier first, and stops there when one of its tests failed."""


def is_fast(item) -> bool:
    return not any(item.get_closest_marker(m) is not None for m in FAST_TIER_SKIP)


def _allowed(item) -> bool:
    return any(item.get_closest_marker(m) is not None for m in SPAWN_MARKS)


def _record(what: str) -> None:
    item = _current[0]
    if getattr(_state, "inside", False):
        return
    key = item.nodeid if item is not None else "(outside a test: collection, session fixtures' teardown)"
    launches[key] = launches.get(key, 0) + 1
    if item is None or _allowed(item):
        return
    _violations.setdefault(item.nodeid, what)


def install() -> None:
    """Wrap the two doors a process goes through (once per session)."""
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def guarded_popen(self, args, *a, **kw):
        argv = args.split() if isinstance(args, str) else [str(x) for x in list(args)]
        if not argv or os.path.basename(argv[0]) not in PROBES:
            _record(f"a process ({' '.join(argv[:3])} ...)")
        _state.inside = True  # a Popen made by a Process.start is the same start
        try:
            popen_init(self, args, *a, **kw)
        finally:
            _state.inside = False

    def guarded_start(self):
        _record(f"a multiprocessing process ({type(self).__name__})")
        _state.inside = True
        try:
            process_start(self)
        finally:
            _state.inside = False

    subprocess.Popen.__init__ = guarded_popen
    multiprocessing.process.BaseProcess.start = guarded_start


def set_current(item) -> None:
    _current[0] = item


def violation_report(item, report) -> None:
    """Turn a passed phase of an unmarked test that started a process into a failure that says the fix."""
    what = _violations.pop(item.nodeid, None)
    if what is None or not report.passed:
        if what is not None:
            _violations[item.nodeid] = what  # keep it for a later phase's report
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{item.nodeid} started {what} but is marked neither slow, distributed nor subprocess: add "
        "@pytest.mark.distributed (ranks), @pytest.mark.slow (training, an engine) or @pytest.mark.subprocess "
        "(a short child process that keeps it in the fast tier); tests/_tiers.py says why"
    )


def per_file_table(durations: list[tuple[float, str, str]], launches: dict[str, int]) -> list[str]:
    """Seconds, tests and launches per test file, the costliest first: where a merge would pay (issue 59).

    Example:
        >>> per_file_table([(2.0, "call", "tests/a.py::t"), (1.0, "setup", "tests/a.py::t")], {"tests/a.py::t": 3})
        ['| s | tests | launches | file |', '| ---: | ---: | ---: | --- |', '| 3.0 | 1 | 3 | `tests/a.py` |']
    """
    files: dict[str, list] = {}
    for took, _, nodeid in durations:
        row = files.setdefault(nodeid.split("::")[0], [0.0, set(), 0])
        row[0] += took
        row[1].add(nodeid)
    for nodeid, n in launches.items():
        if nodeid.split("::")[0] in files:
            files[nodeid.split("::")[0]][2] += n
    rows = sorted(files.items(), key=lambda kv: -kv[1][0])
    return ["| s | tests | launches | file |", "| ---: | ---: | ---: | --- |"] + [
        f"| {s:.1f} | {len(ids)} | {n} | `{f}` |" for f, (s, ids, n) in rows
    ]


__all__ = [
    "FAIL_FAST_ENV",
    "SPAWN_MARKS",
    "install",
    "is_fast",
    "launches",
    "per_file_table",
    "set_current",
    "violation_report",
]
