"""PPO with a learned critic: GAE advantages and the clipped value loss (pure torch).

Shapes are ``[B, T]`` in the project's layout (prompt, response, padding in one row; the mask is 1 on response
tokens); ``values[:, t]`` estimates the state *before* token t is generated, where ``token_logp[:, t]`` sits. The
reward is the 0/1 outcome on the last response token (:func:`outcome_token_rewards`), as the PACS reference's PPO
baseline. Backwards over t, on response tokens only ("next" skips prompt and padding positions)::

    delta_t = r_t + gamma * V_next - V_t          A_t = delta_t + gamma * lam * A_next
    returns = A + V                               A <- (A - mean) / sqrt(var_unbiased + 1e-8)

with the whitening over all response tokens of the batch (verl's ``masked_whiten``). After a row's last response
token V_next = A_next = 0; the reference bootstraps from a padding position instead, so the two agree only at
gamma = lam = 1, its setting (docs/baselines.md, "PPO with a learned critic").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pacs_megatron.pacs.policy_loss import aggregate

WHITEN_EPS = 1e-8
Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a float64 tensor over the data-parallel ranks (e.g. an all-reduce); returns the sum."""


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` zeros except ``scores[b]`` on row b's last response token (none if it has none).

    Example:
        >>> outcome_token_rewards(torch.tensor([1.0, 0.5]), torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])).tolist()
        [[0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.0]]
    """
    m = response_mask.bool()
    T = m.shape[-1]
    last = T - 1 - torch.flip(m, dims=[-1]).int().argmax(dim=-1)
    out = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    rows = torch.arange(m.shape[0], device=m.device)
    out[rows, last] = scores.float().to(m.device)
    return out * m


def _local_sum(x: torch.Tensor) -> torch.Tensor:
    return x


def masked_mean_var(
    x: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 ``(mean, unbiased variance, count)`` of ``x`` over ``mask``, two-pass. ``reduce`` sums a
    float64 tensor over the ranks that hold the other rows (an all-reduce; None: this tensor is all),
    so every rank gets the statistics of the whole batch without gathering its rows."""
    reduce = reduce or _local_sum
    m = mask.to(torch.float64)
    xd = x.to(torch.float64)
    total, n = reduce(torch.stack([(xd * m).sum(), m.sum()])).unbind()
    mean = total / n.clamp(min=1.0)
    var = reduce(((xd - mean) ** 2 * m).sum()) / (n - 1).clamp(min=1.0)
    return mean, var, n


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with mean and unbiased variance over ``mask`` (needs >= 2
    tokens; over all ranks' rows with ``reduce``, see :func:`masked_mean_var`); in ``x``'s dtype."""
    mean, var, n = masked_mean_var(x, mask, reduce)
    if n < 2:
        raise ValueError(f"whitening needs at least 2 response tokens in the batch, got {int(n)}")
    return ((x.to(torch.float64) - mean) * torch.rsqrt(var + WHITEN_EPS)).to(x.dtype)


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE ``(advantages, returns)``, both ``[B, T]`` float32 and zero off the response tokens.

    GAE runs along each row on its own, so a data-parallel rank computes it for its rows alone; only
    the whitening needs the whole batch: ``reduce`` sums its statistics over the ranks."""
    if not (token_rewards.shape == values.shape == response_mask.shape):
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have one [B, T] shape"
        )
    r, v, m = token_rewards.float(), values.float(), response_mask.float()
    B, T = v.shape
    next_value = v.new_zeros(B)
    next_adv = v.new_zeros(B)
    adv = torch.zeros_like(v)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        # Off the response (prompt, padding) the recursion passes its state through unchanged.
        next_value = torch.where(m[:, t] > 0, v[:, t], next_value)
        next_adv = torch.where(m[:, t] > 0, a_t, next_adv)
        adv[:, t] = a_t
    returns = (adv + v) * m
    if whiten:
        adv = masked_whiten(adv, m, reduce)
    return adv * m, returns


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float,
    loss_agg_mode: str = "token-mean",
    horizon: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss ``(loss, clipfrac)``, the reference's ``compute_value_loss`` (verl, from TRL), no factor
    0.5; differentiable in ``vpreds``::

        agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))

    ``agg``: ``loss_agg_mode`` / ``horizon`` as :func:`pacs_megatron.pacs.policy_loss.aggregate` (token-mean by
    default, as the reference's function; its config passes the actor's ``loss_agg_mode``). ``clipfrac``: the
    fraction of response tokens where the clipped term is the larger."""
    m = response_mask.to(vpreds.dtype)
    n = m.sum().clamp(min=1.0)
    clipped = torch.maximum(torch.minimum(vpreds, old_values + clip_range), old_values - clip_range)
    l1 = (vpreds - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = aggregate(torch.maximum(l1, l2), response_mask, loss_agg_mode, horizon)
    clipfrac = ((l2 > l1).to(vpreds.dtype) * m).sum() / n
    return loss, clipfrac.detach()


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None
) -> torch.Tensor:
    """``1 - Var(R - V) / Var(R)`` over the masked tokens (unbiased variances; of all ranks' rows with
    ``reduce``). nan when the returns do not vary (Var(R) <= 1e-12, e.g. every response scored 0):
    there is nothing to explain, and the ratio would be -inf or a huge negative number from round-off."""
    _, var_r, n = masked_mean_var(returns, mask, reduce)
    _, var_d, _ = masked_mean_var(returns.double() - values.double(), mask, reduce)
    if n < 2 or not var_r > 1e-12:
        return torch.tensor(float("nan"))
    return (1.0 - var_d / var_r).float()
