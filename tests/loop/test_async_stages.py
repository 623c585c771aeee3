"""The asynchronous loop's batch stage (async_stages.take_batch) assembles what the synchronous one
(sampling_stages.collect_step) does from the same rollouts: the same batch, metrics and samples, overlong
shaping included (the reward penalty and truncated rows weighted 0). Fake engines behind a real
RolloutPipeline at k = 0, answering as tests/test_sampling_stages.py's engine does on one rank.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

from test_sampling_stages import BASE, _components, _equal_batches

from pacs_megatron.config import load_config
from pacs_megatron.loop import async_stages, sampling_stages
from pacs_megatron.rollout.collect import step_seed
from pacs_megatron.rollout.pipeline import InFlightPrompts


class FakeRemote:
    """The engines of rollout/remote/engines.py in process: a step's groups are the fake engine's answers with the
    seed generate_sharded gives one replica, all sampled with version ``step - 1`` (k = 0)."""

    def __init__(self, engine) -> None:
        self.engine, self.queued = engine, {}

    def submit(self, tag, prompt_ids, sampling, step) -> None:
        seeded = replace(sampling, seed=step_seed(sampling.seed or 0, step, 0))
        self.queued[tag] = (self.engine.generate(prompt_ids, seeded), step - 1)

    def collect(self, tag):
        groups, version = self.queued.pop(tag)
        return groups, [version] * len(groups), 0.0, ([0.0], [0.0])


def test_take_batch_is_collect_step_with_overlong_shaping():
    on = ["algorithm.loss=grpo", "algorithm.overlong.buffer_len=2", "algorithm.overlong.mask_truncated=true"]
    cfg = load_config(None, BASE + on + ["rollout.placement=separate"])
    sync_c, async_c = _components(), _components()
    async_c.engine = FakeRemote(async_c.engine)
    async_c.dataset = InFlightPrompts(async_c.dataset)
    async_c.sync = SimpleNamespace(verify=lambda upto: (math.nan, math.nan))
    pipe = async_stages.start_pipeline(cfg, async_c, 0)
    for step in (1, 2):
        want, want_m, want_s = sampling_stages.collect_step(cfg, sync_c, step)
        got, got_m, got_s = async_stages.take_batch(cfg, async_c, pipe, step)
        pipe.pushed(step)
        assert (want.is_weights == 0).any() and "overlong/penalty_mean" in want_m  # shaping is on
        assert _equal_batches(got, want) and got_s == want_s
        assert got_m["async/staleness_max"] == 0.0
        assert {k: float(v) for k, v in got_m.items() if k in want_m} == {k: float(v) for k, v in want_m.items()}
