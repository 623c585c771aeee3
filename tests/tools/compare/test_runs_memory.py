"""compare on CPU: another run starts only when the host's memory holds it (tools/compare/runs.py). Two SmolLM2 runs
of 10-12 GB each started together on a 24 GB box under the default --jobs (cores // ranks)."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import psutil
import pytest
from _compare_helpers import GENERALIZE, SMALL

from pacs_megatron.tools.compare import runs as compare_runs
from pacs_megatron.tools.compare.runs import HEADROOM, Runner


def _runner(tmp_path, gpus):
    args = argparse.Namespace(config=str(GENERALIZE), out=str(tmp_path), steps=4, overrides=SMALL, jobs=2, gpus=gpus)
    args.ranks_per_run = 1
    return Runner(args)


def _log(runner, spec, *rows):
    d = runner.run_dir(*spec)
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, **r}) + "\n" for i, r in enumerate(rows)))


@pytest.fixture
def host(monkeypatch):
    """Set ``host.free`` (GB available) and ``host.held`` (GB a running run's processes hold now)."""
    state = SimpleNamespace(free=100.0, held=0.0)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=state.free * 1e9))
    monkeypatch.setattr(compare_runs, "_tree_gb", lambda proc: state.held)
    return state


def test_the_next_run_waits_until_the_host_holds_it(tmp_path, host):
    runner = _runner(tmp_path, gpus=[])
    first = ("pacs", 1e-3, 0)
    running = {first: (object(), None)}
    assert runner._host_memory_allows({})  # nothing running: the first run always starts
    assert not runner._host_memory_allows(running)  # its size is unknown until it logs a step
    _log(runner, first, {"perf/peak_rss_gb": 4.0, "perf/peak_rss_gb_rank0": 4.0})
    need = HEADROOM * 4.0
    host.held = 4.0  # it will still grow by need - 4
    host.free = need + (need - 4.0) - 0.1
    assert not runner._host_memory_allows(running)
    host.free += 0.2
    assert runner._host_memory_allows(running)


def test_a_run_is_the_sum_of_its_ranks_and_the_largest_logged(tmp_path, host):
    runner = _runner(tmp_path, gpus=[])
    a, b = ("pacs", 1e-3, 0), ("pacs", 1e-3, 1)
    _log(runner, a, {"perf/peak_rss_gb": 3.0, "perf/peak_rss_gb_rank0": 3.0, "perf/peak_rss_gb_rank1": 2.5})
    _log(runner, b, {"perf/peak_rss_gb": 1.0, "perf/peak_rss_gb_rank0": 1.0}, {"perf/peak_rss_gb_rank0": 2.0})
    host.held, host.free = 100.0, HEADROOM * 5.5 - 0.1  # running ones at their size already: no growth
    assert not runner._host_memory_allows({b: (object(), None)})
    host.free = HEADROOM * 5.5 + 0.1
    assert runner._host_memory_allows({b: (object(), None)})


def test_runs_on_gpus_and_runs_that_log_no_memory_are_not_held(tmp_path, host):
    host.free = 0.0
    gpu = _runner(tmp_path / "gpu", gpus=["0"])
    assert gpu._host_memory_allows({("pacs", 1e-3, 0): (object(), None)})  # their device shares are capped
    cpu = _runner(tmp_path / "cpu", gpus=[])
    _log(cpu, ("pacs", 1e-3, 0), {"reward/mean": 0.5})  # a step logged without perf/*: nothing to go by
    assert cpu._host_memory_allows({("pacs", 1e-3, 0): (object(), None)})
