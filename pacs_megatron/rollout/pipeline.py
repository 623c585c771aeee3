"""Rollouts generated ahead of training, at most ``rollout.max_staleness`` (k) policy versions old.

The policy version of weights is the RL step whose update produced them; the engines start from the
resumed step s0. The schedule (:class:`RolloutPipeline`)::

    start          submit steps s0+1 .. s0+1+k                    (all sampled with version s0)
    after step t   push the weights of version t, then submit step t+1+k

Each engine serves its commands in order (rollout/remote/server.py), so step t+1+k is sampled with version >= t:
the staleness of step s, (s - 1) - version, is at most k. It is exactly min(k, s - 1 - s0), whatever the
engines' speed: a slow engine makes the trainer wait, a slow trainer makes the engines wait, neither
changes which weights sampled which step, so a run is reproducible. k = 0 is the synchronous loop.

Older samples are never trained on. :meth:`RolloutPipeline.take` checks every group's version against the
bound; a group older than k (the schedule never produces one: the check guards against an engine that
missed a load) is dropped, counted in ``async/dropped_samples``, and its prompt regenerated with the
engines' current weights while the trainer waits: no prompt is lost. Still too old after that is an error.

Prompts in flight at a checkpoint (:class:`InFlightPrompts`): the sampler's state is saved as of the first
step not yet trained, with an ``in_flight`` entry naming how many batches were drawn but not trained. A
resumed run draws those prompts again, in the same order, and regenerates them with the checkpoint's
weights: no prompt is lost or trained twice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from pacs_megatron.pacs.decoupled import staleness_metrics
from pacs_megatron.rollout.types import SamplingParams

IN_FLIGHT_NOTE = "drawn, not trained: a resumed run draws these prompts again and regenerates their rollouts"


class InFlightPrompts:
    """A prompt stream (data/sampler.PromptDataset) whose saved state excludes the batches still in flight.

    Example:
        >>> from pacs_megatron.data.records import PromptRecord
        >>> from pacs_megatron.data.sampler import PromptDataset
        >>> recs = [PromptRecord(str(i), "", "", (i,), "", "t") for i in range(5)]
        >>> ds = InFlightPrompts(PromptDataset(recs, seed=0, shuffle=False))
        >>> _ = ds.next_batch(2), ds.next_batch(2)  # two steps drawn ahead
        >>> ds.trained()  # the first one trained
        >>> ds.state_dict()["position"], ds.state_dict()["in_flight"]["prompts"]
        (2, 2)
    """

    def __init__(self, dataset) -> None:
        self.dataset = dataset
        self._drawn: deque[tuple[dict, int]] = deque()  # (state before the draw, prompts), oldest first

    @property
    def records(self) -> list:
        return self.dataset.records

    def __len__(self) -> int:
        return len(self.dataset)

    def next_batch(self, num_prompts: int) -> list:
        state = self.dataset.state_dict()
        out = self.dataset.next_batch(num_prompts)
        self._drawn.append((state, num_prompts))
        return out

    def trained(self) -> None:
        """The oldest batch drawn has been trained on."""
        self._drawn.popleft()

    def state_dict(self) -> dict[str, Any]:
        if not self._drawn:
            return self.dataset.state_dict()
        state = dict(self._drawn[0][0])
        state["in_flight"] = {
            "batches": len(self._drawn),
            "prompts": sum(n for _, n in self._drawn),
            "on_resume": IN_FLIGHT_NOTE,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self._drawn.clear()


@dataclass(frozen=True)
class Taken:
    """One step's rollouts, as the trainer takes them."""

    records: list
    """The step's prompt records, in order."""
    groups: list
    """n responses per record."""
    versions: list[int]
    """The policy version that sampled each group."""
    metrics: dict
    """``async/*``: staleness, drops, waiting and working times."""


class RolloutPipeline:
    """Keeps the next k + 1 steps' rollouts in flight on the engines (``engines``: rollout/remote/engines.py).

    Example (k = 1, fresh run of 4 steps)::

        pipe.start(0)            # steps 1 and 2 submitted, both sampled with version 0
        pipe.take(1)             # staleness 0
        ... train, push version 1 ...
        pipe.pushed(1)           # step 3 submitted (sampled with version 1)
        pipe.take(2)             # staleness 1 (version 0, proximal 1)
    """

    def __init__(
        self,
        engines,
        prompts: InFlightPrompts,
        batch_size: int,
        sampling: SamplingParams,
        max_staleness: int,
        last_step: int,
    ) -> None:
        self.engines, self.prompts, self.batch_size = engines, prompts, batch_size
        self.sampling, self.k, self.last_step = sampling, max_staleness, last_step
        self.in_flight: dict[int, list] = {}  # step -> its prompt records
        self.dropped_total = 0

    def _submit(self, step: int) -> None:
        if step > self.last_step or step in self.in_flight:
            return
        records = self.prompts.next_batch(self.batch_size)
        self.in_flight[step] = records
        self.engines.submit(("step", step), [r.prompt_ids for r in records], self.sampling, step)

    def start(self, resumed_step: int) -> None:
        """Submit the first k + 1 steps after ``resumed_step`` (the engines hold its weights)."""
        for step in range(resumed_step + 1, resumed_step + self.k + 2):
            self._submit(step)

    def pushed(self, version: int) -> None:
        """The weights of ``version`` are queued for the engines: step version + 1 + k may be sampled."""
        self._submit(version + 1 + self.k)

    def take(self, step: int) -> Taken:
        """Collective: the rollouts of ``step``, every group at most k versions older than the proximal policy
        (version step - 1); waits for the engines."""
        records = self.in_flight.pop(step)
        groups, versions, waited, (busy, idle) = self.engines.collect(("step", step))
        proximal = step - 1
        stale = [i for i, v in enumerate(versions) if proximal - v > self.k]
        dropped = len(stale) * self.sampling.n
        if stale:  # guard (never by the schedule): regenerate with the engines' current weights
            tag = ("regenerate", step)
            self.engines.submit(tag, [records[i].prompt_ids for i in stale], self.sampling, step)
            fresh, fresh_versions, more, _ = self.engines.collect(tag)
            waited += more
            for i, g, v in zip(stale, fresh, fresh_versions):
                groups[i], versions[i] = g, v
            still = [versions[i] for i in stale if proximal - versions[i] > self.k]
            if still:
                raise RuntimeError(
                    f"step {step}: engines still sample with version {min(still)} < {proximal - self.k} (proximal "
                    f"{proximal} - rollout.max_staleness {self.k}) after regeneration: an engine missed a weight load"
                )
        self.dropped_total += dropped
        self.prompts.trained()
        metrics = staleness_metrics(torch.tensor(versions), proximal, self.k)
        metrics |= {
            "async/dropped_samples": float(dropped),
            "async/dropped_total": float(self.dropped_total),
            "async/trainer_wait_s": waited,
            "async/engine_busy_s": sum(busy) / len(busy),
            "async/engine_idle_s": sum(idle) / len(idle),
            "async/in_flight_steps": float(len(self.in_flight)),
        }
        return Taken(records, groups, versions, metrics)
