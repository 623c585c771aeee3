"""PPO with a learned critic: GAE advantages and the clipped value loss (pure torch).

Shapes are ``[B, T]`` in the project's layout (prompt, response, padding in one row; the mask is 1
on response tokens). ``values[:, t]`` is the critic's estimate of the state *before* token t is
generated, i.e. it sits where ``token_logp[:, t]`` sits. The reward is the 0/1 outcome placed on
the last response token (:func:`outcome_token_rewards`), as the PACS reference's PPO baseline
(verl ``compute_gae_advantage_return``) does. Backwards over t, on response tokens only::

    delta_t = r_t + gamma * V_next - V_t          A_t = delta_t + gamma * lam * A_next
    returns = A + V                               A <- (A - mean) / sqrt(var_unbiased + 1e-8)

where "next" skips prompt and padding positions, and the mean / variance of the whitening run over
all response tokens of the batch (Bessel-corrected, as verl's ``masked_whiten``). With
gamma = lam = 1 (the reference) every A_t is R - V_t before whitening.

The value loss is verl's (from TRL): ``0.5 * token-mean over response tokens of
max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``; ``clipfrac`` is the fraction of response
tokens where the clipped term is the larger.
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8


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


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with mean and unbiased variance over ``mask`` (needs >= 2)."""
    m = mask.to(x.dtype)
    n = m.sum()
    if n < 2:
        raise ValueError(f"whitening needs at least 2 response tokens in the batch, got {int(n)}")
    mean = (x * m).sum() / n
    var = ((x - mean) ** 2 * m).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS)


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE ``(advantages, returns)``, both ``[B, T]`` float32 and zero off the response tokens."""
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
        adv = masked_whiten(adv, m)
    return adv * m, returns


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss ``(loss, clipfrac)`` (see the module docstring); differentiable in ``vpreds``."""
    m = response_mask.to(vpreds.dtype)
    n = m.sum().clamp(min=1.0)
    clipped = torch.maximum(torch.minimum(vpreds, old_values + clip_range), old_values - clip_range)
    l1 = (vpreds - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * (torch.maximum(l1, l2) * m).sum() / n
    clipfrac = ((l2 > l1).to(vpreds.dtype) * m).sum() / n
    return loss, clipfrac.detach()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(R - V) / Var(R)`` over the masked tokens (unbiased variances). nan when the returns do
    not vary (Var(R) <= 1e-12, e.g. every response scored 0): there is nothing to explain, and the ratio
    would be -inf or a huge negative number from round-off."""
    m = mask.bool()
    r, d = returns[m].double(), (returns - values)[m].double()
    if r.numel() < 2 or not r.var() > 1e-12:
        return torch.tensor(float("nan"))
    return (1.0 - d.var() / r.var()).float()
