"""utils/memory.py: a step's peak RSS is its own (the high-water mark is reset when the step starts)."""

import sys

import pytest
import torch
from _dist import run_distributed

from pacs_megatron.utils.memory import StepMemory, peak_rss_bytes, reset_peak_rss, rss_bytes


def _one_step(rank, world_size):
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB held before the step, then freed
    del big
    mem = StepMemory(torch.device("cpu"))
    mem.start()
    reset_dropped = peak_rss_bytes() - rss_bytes() < 32 * 2**20
    x = torch.ones(128 * 2**20 // 4)  # 128 MiB in flight during the step
    x.add_(1.0)
    del x
    return reset_dropped, mem.metrics(), reset_peak_rss()


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the high-water-mark reset is Linux's")
def test_step_peak_is_the_steps_own():
    # In a fresh process: in pytest's own, memory freed by earlier tests stays resident and a new
    # 128 MiB tensor reuses it without raising the RSS (the full suite measured 0 here).
    reset_dropped, m, reset_ok = run_distributed(_one_step, 1)[0]
    assert reset_dropped, "the reset did not drop the earlier peak"
    assert m["perf/step_rss_gb_rank0"] >= 0.128 * 0.95
    assert m["perf/peak_rss_gb"] == m["perf/peak_rss_gb_rank0"] >= m["perf/step_rss_gb_rank0"]
    assert reset_ok


def _two_ranks(rank, world_size):
    held = torch.ones((rank + 1) * 32 * 2**20 // 4)  # rank r holds (r+1) x 32 MiB during the step
    mem = StepMemory(torch.device("cpu"))
    mem.start()
    held2 = held * 2
    del held2
    return mem.metrics()


@pytest.mark.distributed
def test_every_rank_reports_every_ranks_peak():
    # The gather runs over gloo at world size 2 (a 2-D gather buffer failed there and only there).
    m0, m1 = run_distributed(_two_ranks, 2)
    assert m0 == m1
    assert m0["perf/step_rss_gb_rank1"] > m0["perf/step_rss_gb_rank0"] + 0.02
    assert m0["perf/peak_rss_gb"] == max(m0["perf/peak_rss_gb_rank0"], m0["perf/peak_rss_gb_rank1"])
