"""A step's advantages: from the rewards alone (the outcome estimators), or whatever function the run supplies
(critic_stages: the learned critic's GAE). update_stages.prepare_local_batch calls the run's on this rank's rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.config import RunConfig


class StepAdvantages(NamedTuple):
    """What the advantage stage gives this rank's rows: outcome advantages, or the critic's GAE."""

    advantages: torch.Tensor
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    metrics: dict | None = None


AdvantageFn = Callable[[Rollouts], StepAdvantages]
"""The advantages of this DP rank's rows (collective); critic_stages gives one for runs with a critic."""


def outcome_step_advantages(cfg: RunConfig, rows: Rollouts) -> StepAdvantages:
    """Advantages from the rows' rewards alone, as the loss declared them (``LossTraits.outcome_advantages``:
    the baselines' estimator; PACS's per-row weight of its gradient while psi = 0); 0 for a loss that reads none."""
    advantages = cfg.algorithm.traits.outcome_advantages
    if advantages is None:
        return StepAdvantages(torch.zeros(len(rows)))
    return StepAdvantages(advantages(rows.scores, rows.group_size, cfg.algorithm.loss_config()))
