"""The stages of PPO with a learned critic (``algorithm.policy.adv_estimator=gae``); every one is a
no-op for runs without a critic, so ``train.py`` calls them unconditionally.

    init_after_warmup  (after the format warm-up)  the critic's trunk re-copied from the actor, so the
                   critic starts from the policy that RL starts from (``critic.init=actor``)
    advantages_of  (old-log-prob stage)  the advantage function update_stages.prepare_local_batch calls on this
                   DP rank's rows: critic values -> GAE per row (outcome reward on the last response
                   token) -> advantages whitened over all response tokens of the step (the statistics
                   all-reduced over DP, as the reference whitens the whole batch) -> per-token
                   advantages, old values, returns
    update_critic  (beside the actor update)  critic ppo_epochs x mini-batches of the clipped value
                   loss, one critic optimizer step each (before the actor's, as verl)

Every row stays on its rank: with dynamic batching a rank holds a non-contiguous set of groups
(batch/packing.py ``dp_balanced_shard``), and GAE needs nothing from other rows but the whitening
statistics.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pacs_megatron.batch.build import split_mini_batches
from pacs_megatron.batch.rows import Rollouts, TrainRows
from pacs_megatron.config import RunConfig
from pacs_megatron.loop.advantages import AdvantageFn, StepAdvantages
from pacs_megatron.pacs import PolicyLossConfig, explained_variance, gae_advantages, outcome_token_rewards
from pacs_megatron.pacs.gae import masked_mean_var

if TYPE_CHECKING:
    from pacs_megatron.loop.runtime import Components
    from pacs_megatron.parallel import ParallelGroups


def _sum_dp(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """``x`` summed over the DP ranks (float64, every rank gets the sum)."""
    if groups.dp_size == 1:
        return x
    y = x.to(groups.device)
    dist.all_reduce(y, group=groups.dp_group)
    return y.cpu()


def init_after_warmup(cfg: RunConfig, c: Components) -> None:
    """After the format warm-up the policy RL starts from is the warmed-up actor: re-copy its trunk
    into the critic (``critic.init=actor``; an HF ``critic.init`` is left as loaded)."""
    if c.critic is not None and cfg.critic.init == "actor" and cfg.trainer.sft_warmup_steps:
        c.critic.copy_trunk_from(c.actor)


def advantages_of(cfg: RunConfig, c: Components) -> AdvantageFn | None:
    """The GAE advantage function of a run with a learned critic (None without one: outcome advantages)."""
    if c.critic is None:
        return None
    return partial(gae_step_advantages, cfg, c)


def gae_step_advantages(cfg: RunConfig, c: Components, local: Rollouts) -> StepAdvantages:
    """GAE ``advantages [B, T]``, ``old_values`` and ``returns`` of this rank's rows (collective over DP)."""
    assert c.critic is not None
    reduce = partial(_sum_dp, groups=c.rt.groups)
    values = c.critic.compute_values(local)
    pol = cfg.algorithm.loss_config()
    assert isinstance(pol, PolicyLossConfig)  # a critic runs with ppo's policy.adv_estimator=gae
    mask = local.response_mask
    rewards = outcome_token_rewards(local.scores, mask)
    adv, returns = gae_advantages(rewards, values, mask, pol.gamma, pol.lam, whiten=True, reduce=reduce)
    metrics = {
        "critic/values_mean": float(masked_mean_var(values, mask, reduce)[0]),
        "critic/returns_mean": float(masked_mean_var(returns, mask, reduce)[0]),
        "critic/explained_variance": float(explained_variance(values, returns, mask, reduce)),
    }
    return StepAdvantages(adv, values, returns, metrics)


def update_critic(cfg: RunConfig, c: Components, local: TrainRows) -> dict:
    """Critic epochs over this rank's mini-batches; metrics averaged over its steps ({} without critic)."""
    if c.critic is None:
        return {}
    per_rank_prompts = cfg.mini_batch_prompts // c.rt.groups.dp_size
    epochs = cfg.critic.ppo_epochs or cfg.algorithm.ppo_epochs
    minis = split_mini_batches(local, per_rank_prompts)
    history = [c.critic.train_step(mini) for _ in range(epochs) for mini in minis]
    return {k: sum(h[k] for h in history) / len(history) for k in history[0]}
