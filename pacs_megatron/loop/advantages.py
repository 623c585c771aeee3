"""A step's advantages: from the rewards alone (the outcome estimators), or whatever function the run supplies
(critic_stages: the learned critic's GAE). update_stages.prepare_local_batch calls the run's on this rank's rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pacs_megatron.config import RunConfig
from pacs_megatron.data.batching import Rollouts
from pacs_megatron.pacs import PolicyLossConfig, get_loss, group_advantage, outcome_advantages


class StepAdvantages(NamedTuple):
    """What the advantage stage gives this rank's rows: outcome advantages, or the critic's GAE."""

    advantages: torch.Tensor
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    metrics: dict | None = None


AdvantageFn = Callable[[Rollouts], StepAdvantages]
"""The advantages of this DP rank's rows (collective); critic_stages gives one for runs with a critic."""


def outcome_step_advantages(cfg: RunConfig, rows: Rollouts) -> StepAdvantages:
    """Advantages from the rows' rewards alone: the loss's estimator for the baselines (GRPO, PPO, GSPO);
    for PACS, its ``adv_estimator`` of R, the per-row weight of its gradient while psi = 0 (the loss
    computes its own score from r); 0 for losses that read none (``sft``, a custom loss)."""
    loss_cfg = cfg.algorithm.loss_config()
    if get_loss(cfg.algorithm.loss).needs_advantages and isinstance(loss_cfg, PolicyLossConfig):
        return StepAdvantages(outcome_advantages(rows.scores, rows.group_size, loss_cfg))
    if cfg.algorithm.loss == "pacs":
        return StepAdvantages(group_advantage(rows.scores.float(), rows.group_size, loss_cfg.adv_estimator))
    return StepAdvantages(torch.zeros(len(rows)))
