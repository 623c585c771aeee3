"""Clipped policy-gradient losses for the paper's baselines (GRPO, PPO-clip) and GSPO, token level.

Shapes: ``[B, T]`` log-probs and mask; ``advantages [B]`` (outcome advantages broadcast over the response
tokens) or ``[B, T]`` (GAE from a learned critic, gae.py). With ratio_t = exp(logp_t - old_logp_t)::

    l_t = max(-A * ratio_t, -A * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    l_t = min(l_t, -A * c)   where A < 0            (dual-clip, c = clip_ratio_c, the reference's 3.0)

aggregated by ``loss_agg_mode`` (:func:`aggregate`). Masked importance sampling (``is_weights`` with zeros,
rollout_correction.py) rejects tokens or rows: they leave the mask, so they leave every denominator too.
GSPO (:func:`gspo_policy_loss`) puts the sequence's length-normalised ratio in place of ratio_t. Each against
verl and the reference: docs/baselines.md.
"""

from __future__ import annotations

import torch

from pacs_megatron.pacs.advantage import group_advantage
from pacs_megatron.pacs.config import PolicyLossConfig
from pacs_megatron.pacs.rollout_correction import kept_mask


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, horizon: int = 0) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss ``l`` to a scalar, by ``mode`` (``loss_agg_mode``).

    With m the mask and B the number of rows with a token in it::

        token-mean               sum_{i,t} m l / sum_{i,t} m         (every token of the batch equal)
        seq-mean-token-sum       1/B sum_i sum_t m l
        seq-mean-token-mean      1/B sum_i (sum_t m l / sum_t m)
        seq-mean-token-sum-norm  1/B sum_i sum_t m l / H             (Dr.GRPO; H = ``horizon``, else T)
    """
    m = mask.to(loss_mat.dtype)
    rows = (m.sum(dim=-1) > 0).to(loss_mat.dtype).sum().clamp(min=1.0)  # an empty row is no sequence
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum":
        return (loss_mat * m).sum(dim=-1).sum() / rows
    if mode == "seq-mean-token-mean":
        return ((loss_mat * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)).sum() / rows
    if mode == "seq-mean-token-sum-norm":
        return (loss_mat * m).sum(dim=-1).sum() / rows / float(horizon or loss_mat.shape[-1])
    raise ValueError(
        f"loss_agg_mode={mode!r}: choose token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm"
    )


def outcome_advantages(scores: torch.Tensor, group_size: int, config: PolicyLossConfig) -> torch.Tensor:
    """Advantages ``[B]`` of the baselines, from the 0/1 verifiable rewards ``scores [B]``."""
    if config.adv_estimator == "auto":
        raise ValueError("PolicyLossConfig.adv_estimator='auto' must be resolved (AlgorithmConfig does it)")
    return group_advantage(scores.float(), group_size, config.adv_estimator, config.norm_adv_by_std)


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate (GRPO is the same surrogate with group-normalised advantages).

    ``is_weights`` (``[B, T]`` or ``[B, 1]``, no gradient): rollout-correction weights pi_old / pi_rollout
    (truncated or masked, pacs/rollout_correction.py) multiplying each token's surrogate l_t, as verl's
    rollout correction does: the clipped objective is an expectation under pi_old, the tokens were drawn
    from pi_rollout. A weight of exactly 0 (masked IS) rejects the unit: it leaves the mask."""
    if advantages.shape not in ((logp.shape[0],), tuple(logp.shape)):
        raise ValueError(f"advantages must be [B] or [B, T]={tuple(logp.shape)}, got {tuple(advantages.shape)}")
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    # Clamp the log-ratio before exp: a masked (padding) position may hold garbage.
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss_mat, dtype=torch.bool)
    if config.clip_ratio_c:
        dual = -adv * config.clip_ratio_c
        dual_clipped = (adv < 0) & (loss_mat > dual)
        loss_mat = torch.where(adv < 0, torch.minimum(loss_mat, dual), loss_mat)
    mask = kept_mask(response_mask, is_weights)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.to(loss_mat.dtype).detach()
    loss = aggregate(loss_mat, mask, config.loss_agg_mode, config.loss_agg_horizon)
    with torch.no_grad():
        m = mask.to(logp.dtype)
        denom = m.sum().clamp(min=1.0)
        metrics = {
            "policy/loss": loss.detach(),
            "policy/clipfrac": ((clipped > unclipped).to(logp.dtype) * m).sum() / denom,
            "policy/clipfrac_lower": (dual_clipped.to(logp.dtype) * m).sum() / denom,
            "policy/approx_kl": (0.5 * log_ratio.pow(2) * m).sum() / denom,
            "policy/advantage_mean": (
                advantages.float().mean() if advantages.dim() == 1 else (advantages.float() * m).sum() / denom
            ),
        }
    return loss, metrics


def gspo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    config: PolicyLossConfig,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's clipped surrogate on the sequence ratio, as verl's ``compute_policy_loss_gspo``: no dual-clip, the
    log-ratio clamped at 10 before exp, ``config.loss_agg_mode`` (GSPOConfig: seq-mean-token-mean, verl's)::

        s_i     = exp(1/|y_i| sum_t (logp_t - old_logp_t))
        s_{i,t} = sg[s_i] * pi_t / sg[pi_t]          (value s_i at every token, gradient s_i * grad log pi_t)

    ``is_weights`` multiply each token's term as in :func:`clipped_policy_loss`; units they reject (weight 0)
    leave the mask, so they leave s_i's mean too, as verl's rejection sampling removes them from the response
    mask before the loss."""
    if advantages.shape not in ((logp.shape[0],), tuple(logp.shape)):
        raise ValueError(f"advantages must be [B] or [B, T]={tuple(logp.shape)}, got {tuple(advantages.shape)}")
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    mask = kept_mask(response_mask, is_weights)
    m = mask.to(logp.dtype)
    # Padding may hold garbage (NaN old log-probs before their pass): zero it before the row mean.
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp(min=1.0)  # [B]: log s_i
    log_s = (logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_s)  # [B, T]: value s_i at every token, gradient s_i * grad logp_t
    unclipped = -adv * s
    clipped = -adv * s.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.to(loss_mat.dtype).detach()
    loss = aggregate(loss_mat, mask, config.loss_agg_mode, config.loss_agg_horizon)
    with torch.no_grad():
        rows = mask.any(-1)
        denom = m.sum().clamp(min=1.0)
        seq = seq_log_ratio[rows]
        metrics = {
            "policy/loss": loss.detach(),
            "policy/clipfrac": ((clipped > unclipped).to(logp.dtype) * m).sum() / denom,
            "policy/approx_kl": (0.5 * log_ratio.pow(2) * m).sum() / denom,
            "policy/advantage_mean": (
                advantages.float().mean() if advantages.dim() == 1 else (advantages.float() * m).sum() / denom
            ),
            "policy/gspo_seq_log_ratio_abs_mean": seq.abs().mean() if seq.numel() else torch.zeros(()),
        }
    return loss, metrics
