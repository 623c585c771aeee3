"""The two stages of PPO with a learned critic (``algorithm.policy.adv_estimator=gae``); both are
no-ops for runs without a critic, so ``train.py`` calls them unconditionally.

    attach_values  (old-log-prob stage)  critic values of this DP rank's rows -> gathered over DP
                   -> GAE over the step's whole batch (outcome reward on the last response token,
                   advantages whitened over all its response tokens, as the reference) -> this
                   rank's rows get per-token advantages, old values and returns
    update_critic  (beside the actor update)  critic ppo_epochs x mini-batches of the clipped value
                   loss, one critic optimizer step each (before the actor's, as verl)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pacs_megatron.config import RunConfig
from pacs_megatron.data.batching import TrainBatch, split_mini_batches
from pacs_megatron.pacs import explained_variance, gae_advantages, outcome_token_rewards


def _gather_dp(x: torch.Tensor, groups) -> torch.Tensor:
    """Concatenate the DP ranks' ``[B_local, T]`` tensors in rank order (every rank gets all)."""
    if groups.dp_size == 1:
        return x
    parts = [torch.empty_like(x, device=groups.device) for _ in range(groups.dp_size)]
    dist.all_gather(parts, x.to(groups.device), group=groups.dp_group)
    return torch.cat(parts).cpu()


def attach_values(cfg: RunConfig, c, batch: TrainBatch, local: TrainBatch) -> tuple[TrainBatch, dict]:
    """``local`` with GAE ``advantages [B, T]``, ``old_values`` and ``returns`` filled (collective);
    unchanged when the run has no critic."""
    critic = getattr(c, "critic", None)
    if critic is None:
        return local, {}
    groups = c.rt.groups
    values = _gather_dp(critic.compute_values(local), groups)
    pol = cfg.algorithm.loss_config()
    rewards = outcome_token_rewards(batch.scores, batch.response_mask)
    adv, returns = gae_advantages(rewards, values, batch.response_mask, pol.gamma, pol.lam, whiten=True)
    per = len(local)
    rows = slice(groups.dp_rank * per, (groups.dp_rank + 1) * per)
    m = batch.response_mask.float()
    metrics = {
        "critic/values_mean": float((values * m).sum() / m.sum().clamp(min=1.0)),
        "critic/returns_mean": float((returns * m).sum() / m.sum().clamp(min=1.0)),
        "critic/explained_variance": float(explained_variance(values, returns, batch.response_mask)),
    }
    return local.with_(advantages=adv[rows], old_values=values[rows], returns=returns[rows]), metrics


def update_critic(cfg: RunConfig, c, local: TrainBatch) -> dict:
    """Critic epochs over this rank's mini-batches; metrics averaged over its steps ({} without critic)."""
    critic = getattr(c, "critic", None)
    if critic is None:
        return {}
    per_rank_prompts = cfg.mini_batch_prompts // c.rt.groups.dp_size
    epochs = cfg.critic.ppo_epochs or cfg.algorithm.ppo_epochs
    history = [critic.train_step(mini) for _ in range(epochs) for mini in split_mini_batches(local, per_rank_prompts)]
    return {k: sum(h[k] for h in history) / len(history) for k in history[0]}
