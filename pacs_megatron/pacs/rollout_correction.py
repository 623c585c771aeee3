"""Rollout/actor mismatch: measured every step, corrected by importance weights (pure torch).

The engine samples from pi_rollout (FP8 weights, another kernel, another dtype); every loss here is an
expectation under pi_old (the actor's own log-probs of the same tokens). Shapes: ``[B, T]`` log-probs and
response mask (``token_logp`` convention of data/batching.py), ``[B]`` per row.

    delta_t    = old_logp_t - rollout_logp_t                           (log-ratio per response token)
    token      : rho_t = exp(delta_t)                                  -> weights [B, T]
    sequence   : rho_i = exp(sum_t delta_t)    (log-ratio clamped to +-20 before exp) -> weights [B, 1]
    tis        : w = min(rho, C)                                       (truncated IS; only large ratios clipped)
    mis        : w = rho * 1[1/C <= rho <= C]                          (masked IS: units outside are dropped)

A dropped unit has w = 0 exactly (a kept one has w >= 1/C > 0): the losses read w == 0 as "rejected"
and take the unit out of their mask and denominators (:func:`kept_mask`, :func:`kept_rows`), so a
rejected token or row does not dilute the others' mean (the bug verl #3915 and slime #657 fixed).

Weights are constants (no gradient): they reweight the samples pi_rollout drew into pi_old's
expectation; the losses multiply their per-token surrogate (GRPO/PPO, as verl's rollout correction
does) or a row's BCE weight (PACS, see pacs/loss.py). Mismatch metrics (``rollout/logprob_diff_*``,
``rollout/kl_*``) let a NaN through as NaN: a broken engine must not read as "no mismatch".

Example:
    >>> old = torch.tensor([[0.0, -1.0, -1.0]]); ro = torch.tensor([[0.0, -2.0, -1.0]])
    >>> mask = torch.tensor([[False, True, True]])
    >>> w, m = importance_weights(old, ro, mask, "tis", cap=2.0, level="token")
    >>> [round(x, 4) for x in w[0].tolist()], m["rollout/is_clipped_frac"].item()
    ([0.0, 2.0, 1.0], 0.5)
"""

from __future__ import annotations

import torch

_MAX_LOG_RATIO = 20.0


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The response-token entries as a flat tensor (indexing, not multiplying: 0 * NaN would hide nothing,
    but padding positions may hold anything and must not enter)."""
    return values[mask.bool()]


def kept_mask(response_mask: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    """``[B, T]`` bool: the response tokens masked IS kept (``is_weights`` ``[B, T]`` or ``[B, 1]``; 0 = dropped)."""
    mask = response_mask.bool()
    if is_weights is None:
        return mask
    return mask & (is_weights.detach() != 0)


def kept_rows(num_rows: int, is_weights: torch.Tensor | None, device: torch.device | str | None = None) -> torch.Tensor:
    """``[B]`` bool: the rows a sequence-level masked IS kept (all rows without weights)."""
    if is_weights is None:
        return torch.ones(num_rows, dtype=torch.bool, device=device)
    return is_weights.detach().reshape(num_rows, -1).ne(0).any(dim=-1)


def mismatch_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor) -> dict:
    """``rollout/logprob_diff_mean|max`` = mean / max |rollout - old| over response tokens;
    ``rollout/kl_seq`` = mean over rows of sum_t (rollout - old) (the k1 estimate of KL(pi_rollout || pi_old)
    per sequence: the tokens were drawn from pi_rollout); ``rollout/k3_kl_seq`` = mean over rows of
    sum_t (rho - 1 - log rho) with rho = pi_old / pi_rollout (k3: non-negative, lower variance)."""
    mask = response_mask.bool()
    delta = (old_logp.double() - rollout_logp.double()).masked_fill(~mask, 0.0)
    # masked_fill keeps NaN where the mask is on: a NaN log-prob stays NaN in every metric below.
    diff = _masked(delta.abs(), mask)
    k3 = torch.expm1(delta.clamp(max=_MAX_LOG_RATIO)) - delta
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    return {
        "rollout/logprob_diff_mean": diff.mean() if diff.numel() else nan,
        "rollout/logprob_diff_max": diff.max() if diff.numel() else nan,
        "rollout/kl_seq": (-delta).sum(-1).mean(),
        "rollout/k3_kl_seq": k3.sum(-1).mean(),
    }


def importance_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    cap: float,
    level: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights pi_old / pi_rollout, truncated (``tis``) or masked (``mis``) at ``cap``.

    Returns ``(weights, metrics)``: float32 weights ``[B, T]`` (``level="token"``; 0 off the response)
    or ``[B, 1]`` (``level="sequence"``), and ``rollout/is_weight_mean`` (over response tokens or rows)
    and ``rollout/is_clipped_frac`` (fraction of units truncated or dropped).
    """
    if mode not in ("tis", "mis"):
        raise ValueError(f"rollout correction {mode!r}: choose 'tis' or 'mis'")
    if level not in ("token", "sequence"):
        raise ValueError(f"importance level {level!r}: choose 'token' or 'sequence'")
    if not cap > 1:
        raise ValueError(f"is_cap={cap} must be > 1")
    mask = response_mask.bool()
    delta = (old_logp.double() - rollout_logp.double()).masked_fill(~mask, 0.0)
    if level == "sequence":
        delta, unit_mask = delta.sum(-1, keepdim=True), torch.ones_like(delta[:, :1], dtype=torch.bool)
    else:
        unit_mask = mask
    rho = torch.exp(delta.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    if mode == "tis":
        clipped = rho > cap
        w = rho.clamp(max=cap)
    else:
        clipped = (rho > cap) | (rho < 1.0 / cap)
        w = torch.where(clipped, torch.zeros_like(rho), rho)
    w = w.masked_fill(~unit_mask, 0.0).float()
    metrics = {
        "rollout/is_weight_mean": _masked(w.double(), unit_mask).mean(),
        "rollout/is_clipped_frac": _masked(clipped.double(), unit_mask).mean(),
    }
    return w, metrics
