"""Where a step's rollouts come from, chosen once per run: train.py has one step loop over a
:class:`RolloutSource`.

    Colocated  (rollout.placement=colocated)  the engine shares the trainer's ranks: generate, score and
               assemble the step's batch, then put the engine to sleep while the actor trains; after the
               update the weights are synced into it and verified before the next step samples.
    Pipelined  (rollout.placement=separate)  engines on their own ranks sample up to k steps ahead
               (rollout/pipeline.py): take the step's rollouts, verifying the weight versions that sampled
               them; after the update push the weights as a new policy version, and once the step's
               validation is queued behind the batches in flight, let step + 1 + k be sampled.

Both return the same ``(rollouts, metrics, samples)`` and take the same sync metrics, so the update, the
validation and the end of a step are one code path (slime's train.py / train_async.py split, folded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.config import RunConfig
from pacs_megatron.loop import async_stages, sampling_stages

if TYPE_CHECKING:
    from pacs_megatron.loop.runtime import Components
    from pacs_megatron.rollout.pipeline import RolloutPipeline


class RolloutSource(Protocol):
    """A step's rollouts in, the updated weights out (every method collective)."""

    def take(self, step: int) -> tuple[Rollouts, dict, list]:
        """Step ``step``'s rollouts, their metrics, and a few samples for rollouts.jsonl."""
        ...

    def push(self, step: int) -> dict:
        """The weights after step ``step``'s update, to the engines; the sync's metrics."""
        ...

    def step_done(self, step: int) -> None:
        """Step ``step`` is trained, pushed and (when due) validated."""
        ...


class Colocated:
    """The engine on the trainer's ranks, in turn with the actor."""

    def __init__(self, cfg: RunConfig, c: Components) -> None:
        self.cfg, self.c = cfg, c

    def take(self, step: int) -> tuple[Rollouts, dict, list]:
        out = sampling_stages.collect_step(self.cfg, self.c, step)  # prompts, rollouts, rewards
        self.c.engine.sleep()  # free the engine's memory while the actor trains
        return out

    def push(self, step: int) -> dict:  # noqa: ARG002 - the engine holds one version: the latest
        return self.c.sync.sync().metrics()  # the engine wakes for it and stays awake for the next rollout

    def step_done(self, step: int) -> None:
        """Nothing is in flight."""


class Pipelined:
    """Engines on their own ranks, sampling up to ``rollout.max_staleness`` steps ahead."""

    def __init__(self, cfg: RunConfig, c: Components, resumed_step: int) -> None:
        self.cfg, self.c = cfg, c
        self.pipe: RolloutPipeline = async_stages.start_pipeline(cfg, c, resumed_step)  # k + 1 steps in flight

    def take(self, step: int) -> tuple[Rollouts, dict, list]:
        # waiting for the engines (async/trainer_wait_s); the verify of the weights pushed after step - 1
        # may fail, as the colocated sync's does
        return async_stages.take_batch(self.cfg, self.c, self.pipe, step)

    def push(self, step: int) -> dict:
        return async_stages.push_weights(self.cfg, self.c, step)

    def step_done(self, step: int) -> None:
        self.pipe.pushed(step)  # step + 1 + k may now be sampled (with these weights or newer)


def rollout_source(cfg: RunConfig, c: Components, resumed_step: int) -> RolloutSource:
    """The run's source of rollouts (``rollout.placement``), started after ``resumed_step``."""
    if cfg.rollout.placement == "separate":
        return Pipelined(cfg, c, resumed_step)
    return Colocated(cfg, c)
