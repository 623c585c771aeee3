"""The async benchmark's plan and report (pacs_megatron/bench/async_rollout.py) without launching a run:
equal processes in every variant, the trainer cores left after the engines, speed-ups against the colocated
variant of the same round."""

from __future__ import annotations

import pytest

from pacs_megatron.bench.async_rollout import render, summarize, variants


def test_every_variant_uses_the_same_cores():
    plan = variants(cores=4, engines=1, staleness=[0, 2])
    assert plan == {
        "colocated": ["parallel.tp=4"],
        "separate-k0": ["parallel.tp=3", "rollout.placement=separate", "rollout.engines=1", "rollout.max_staleness=0"],
        "separate-k2": ["parallel.tp=3", "rollout.placement=separate", "rollout.engines=1", "rollout.max_staleness=2"],
    }
    with pytest.raises(SystemExit, match="must leave trainer cores"):
        variants(cores=2, engines=2, staleness=[1])


def test_summary_skips_the_first_steps_and_renders_the_ratio():
    rows = [{"timing/step_s": 9.0, "reward/mean": 0.0}] + [
        {"timing/step_s": 1.0 + 0.1 * i, "timing/rollout_s": 0.2, "reward/mean": 0.5} for i in range(5)
    ]
    s = summarize(rows, skip=1)
    assert s["timing/step_s"] == 1.2 and s["timing/update_s"] == 0.0 and s["reward_last"] == 0.5
    result = {"median": {"colocated": s | {"speedup_vs_colocated": 1.0}}, "rounds": [{}], "machine": "m"}
    table = render(result)
    assert table.splitlines()[1].split()[:3] == ["colocated", "1.200", "1.000"]
