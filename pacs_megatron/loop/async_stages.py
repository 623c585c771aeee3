"""The stages the asynchronous loop adds (``rollout.placement=separate``, docs/async.md): take a step's rollouts
from the pipeline, push the weights as a new policy version. The batch, the update and the metrics are the
synchronous loop's own stages (stages.py); only where the rollouts come from and when the weights leave
differ, as in slime's train_async.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.config import RunConfig
from pacs_megatron.loop import sampling_stages, stages
from pacs_megatron.rollout.pipeline import InFlightPrompts, RolloutPipeline

if TYPE_CHECKING:
    from pacs_megatron.loop.runtime import Components


def start_pipeline(cfg: RunConfig, c: Components, resumed_step: int) -> RolloutPipeline:
    """Submit the first k + 1 steps after ``resumed_step`` (the engines hold its weights)."""
    if not isinstance(c.dataset, InFlightPrompts):
        raise TypeError("the asynchronous loop needs the prompt stream wrapped in InFlightPrompts (runtime.py)")
    pipe = RolloutPipeline(
        c.engine,
        c.dataset,
        cfg.trainer.train_batch_size,
        stages.train_sampling(cfg),
        cfg.rollout.max_staleness,
        cfg.trainer.total_steps,
    )
    pipe.start(resumed_step)
    return pipe


def take_batch(cfg: RunConfig, c: Components, pipe: RolloutPipeline, step: int) -> tuple[Rollouts, dict, list]:
    """Wait for step ``step``'s rollouts (at most k versions old), verify the weight versions they were sampled
    with, and assemble the batch: ``(batch, metrics, samples)`` as sampling_stages.collect_step returns (overlong
    shaping included; dynamic sampling is refused with this loop: config/switches.py)."""
    taken = pipe.take(step)
    # An engine answers in order: the probes of every version up to these samples' have arrived. Verifying
    # exactly those (not whatever else came in by now) keeps the metrics independent of timing.
    diff, _ = c.sync.verify(max(taken.versions))
    scored = stages.score_groups(c, taken.records, taken.groups)
    batch, m, samples = stages.assemble_batch(cfg, c, scored, step)
    batch, shaping = sampling_stages.shape_overlong(cfg, batch, scored)
    if not math.isnan(diff):
        m["sync/verified_logprob_diff"] = diff
    return batch, taken.metrics | m | shaping, samples


def push_weights(cfg: RunConfig, c: Components, step: int) -> dict:
    """Stage the updated weights as policy version ``step`` for the engines. With k = 0 (and at the last step)
    wait until every engine loaded and probed them, as the colocated sync does."""
    wait = cfg.rollout.max_staleness == 0 or step == cfg.trainer.total_steps
    return c.sync.sync(version=step, wait=wait).metrics()
