"""Rollout/actor mismatch: measured every step, corrected by importance weights (pure torch).

The engine samples from pi_rollout (FP8 weights, another kernel, another dtype); every loss here is an
expectation under pi_old (the actor's own log-probs of the same tokens). Shapes: ``[B, T]`` log-probs and
response mask (``token_logp`` convention of batch/build.py), ``[B]`` per row. With delta_t = old_logp_t -
rollout_logp_t (log-ratio per response token)::

    token      : rho_t = exp(delta_t)                                  -> weights [B, T]
    sequence   : rho_i = exp(sum_t delta_t)    (log-ratio clamped to +-20 before exp) -> weights [B, 1]
    tis        : w = min(rho, C)                                       (truncated IS; only large ratios clipped)
    mis        : w = rho * 1[1/C <= rho <= C]                          (masked IS: units outside are dropped)

times any of the rejection masks icepop, geo and outlier (:func:`correction_weights`). A dropped unit has w = 0
exactly, which the losses read as "rejected" (:func:`kept_mask`, :func:`kept_rows`). Weights carry no gradient;
mismatch metrics let a NaN through as NaN. The menu and PACS's row rule: docs/fp8.md, "The mismatch menu".
"""

from __future__ import annotations

import math

import torch

from pacs_megatron.pacs.config import RolloutCorrectionConfig

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


QUANTILES = (0.01, 0.5, 0.99)


def quantiles(values: torch.Tensor, qs: tuple[float, ...] = QUANTILES) -> list[torch.Tensor]:
    """Linearly interpolated quantiles of a flat tensor (torch.quantile's default), by sorting: torch.quantile
    refuses more than 2^24 elements, a long-context step's token count. NaN if any value is NaN or none.

    Example:
        >>> [round(float(q), 3) for q in quantiles(torch.tensor([4.0, 1.0, 3.0, 2.0]))]
        [1.03, 2.5, 3.97]
    """
    x = values.double().flatten()
    if x.numel() == 0 or bool(torch.isnan(x).any()):
        return [torch.tensor(float("nan"), dtype=torch.float64) for _ in qs]
    x = x.sort().values
    out = []
    for q in qs:
        pos = q * (x.numel() - 1)
        lo = int(pos)
        hi = min(lo + 1, x.numel() - 1)
        out.append(x[lo] + (x[hi] - x[lo]) * (pos - lo))
    return out


def mismatch_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor) -> dict:
    """``rollout/logprob_diff_mean|max`` = mean / max |rollout - old| over response tokens;
    ``rollout/kl_seq`` = mean over rows of sum_t (rollout - old) (the k1 estimate of KL(pi_rollout || pi_old)
    per sequence: the tokens were drawn from pi_rollout); ``rollout/k3_kl_seq`` = mean over rows of
    sum_t (rho - 1 - log rho) with rho = pi_old / pi_rollout (k3: non-negative, lower variance);
    ``rollout/ratio_p01|p50|p99``: quantiles of the token ratio rho_t over response tokens, and
    ``rollout/geo_ratio_p01|p50|p99`` of the rows' geometric-mean ratio exp(mean_t log rho_t) (what the
    icepop and geo bounds are set against). Over this rank's rows (rank 0 logs its own)."""
    mask = response_mask.bool()
    delta = (old_logp.double() - rollout_logp.double()).masked_fill(~mask, 0.0)
    # masked_fill keeps NaN where the mask is on: a NaN log-prob stays NaN in every metric below.
    diff = _masked(delta.abs(), mask)
    k3 = torch.expm1(delta.clamp(max=_MAX_LOG_RATIO)) - delta
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    rows = mask.any(-1)
    geo = _geo_log_ratio(delta, mask)[rows]
    metrics = {
        "rollout/logprob_diff_mean": diff.mean() if diff.numel() else nan,
        "rollout/logprob_diff_max": diff.max() if diff.numel() else nan,
        "rollout/kl_seq": (-delta).sum(-1).mean(),
        "rollout/k3_kl_seq": k3.sum(-1).mean(),
    }
    for name, log_ratio in (("ratio", _masked(delta, mask)), ("geo_ratio", geo)):
        for q, v in zip(QUANTILES, quantiles(log_ratio)):  # exp is monotone: quantiles of the log, then exp
            metrics[f"rollout/{name}_p{round(q * 100):02d}"] = torch.exp(v.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return metrics


def _geo_log_ratio(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` mean_t delta_t over each row's response tokens (0 for a row without any)."""
    return delta.sum(-1) / mask.sum(-1).clamp(min=1)


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

    Example:
        >>> old = torch.tensor([[0.0, -1.0, -1.0]]); ro = torch.tensor([[0.0, -2.0, -1.0]])
        >>> mask = torch.tensor([[False, True, True]])
        >>> w, m = importance_weights(old, ro, mask, "tis", cap=2.0, level="token")
        >>> [round(x, 4) for x in w[0].tolist()], m["rollout/is_clipped_frac"].item()
        ([0.0, 2.0, 1.0], 0.5)
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


def correction_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor, cfg: RolloutCorrectionConfig
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The menu (module docstring): ``cfg.weight`` times each mask of ``cfg.masks``.

    Returns ``(weights, metrics)``: None when nothing is on; else float32 ``[B, T]`` (``cfg.unit="token"``,
    0 off the response and on masked tokens and rows) or ``[B, 1]`` (``"row"``, 0 on a dropped row).
    Metrics: the weight's ``rollout/is_*`` (tis / mis); per mask the fraction it masks,
    ``rollout/icepop_masked_frac`` (of response tokens), ``rollout/geo_masked_frac`` and
    ``rollout/outlier_masked_frac`` (of rows); with any mask or mis, ``rollout/masked_token_frac`` and
    ``rollout/masked_row_frac``: the response tokens and rows left with weight 0 by all of them together.

    Example:
        >>> from pacs_megatron.pacs.config import RolloutCorrectionConfig
        >>> old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]]); ro = torch.tensor([[-1.0, -2.0], [-1.0, -1.1]])
        >>> w, m = correction_weights(old, ro, torch.ones(2, 2), RolloutCorrectionConfig(masks=("icepop",)))
        >>> w.tolist(), m["rollout/icepop_masked_frac"].item()
        ([[1.0, 0.0], [1.0, 1.0]], 0.25)
    """
    if not cfg.active:
        return None, {}
    mask = response_mask.bool()
    rows = mask.any(-1)
    if cfg.weight != "none":
        w, metrics = importance_weights(old_logp, rollout_logp, mask, cfg.weight, cfg.cap, cfg.level)
        w = w.double()
    else:
        w, metrics = (mask.double() if cfg.unit == "token" else torch.ones_like(mask[:, :1], dtype=torch.float64)), {}
    delta = (old_logp.double() - rollout_logp.double()).masked_fill(~mask, 0.0)
    # Compare log-ratios with log-bounds: exact where exp would overflow, and log(0) = -inf keeps low=0 open.
    keep_tok = torch.ones_like(mask)
    keep_row = torch.ones_like(rows)
    if "icepop" in cfg.masks:
        inside = _within(delta, cfg.icepop) | ~mask
        metrics["rollout/icepop_masked_frac"] = _masked((~inside).double(), mask).mean()
        keep_tok &= inside
    if "geo" in cfg.masks:
        inside = _within(_geo_log_ratio(delta, mask), cfg.geo)
        metrics["rollout/geo_masked_frac"] = (~inside)[rows].double().mean()
        keep_row &= inside
    if "outlier" in cfg.masks:
        inside = (_within(delta, cfg.outlier) | ~mask).all(-1)
        metrics["rollout/outlier_masked_frac"] = (~inside)[rows].double().mean()
        keep_row &= inside
    # torch.where, not a product: a masked unit's weight is exactly 0 even where its ratio is NaN.
    if cfg.unit == "row":  # PACS: a token mask drops the row (module docstring); w is [B, 1] here
        w = torch.where((keep_row & keep_tok.all(-1)).unsqueeze(-1), w, 0.0)
        kept_tok = (w != 0) & mask
    else:
        w = torch.where(keep_tok & keep_row.unsqueeze(-1) & mask, w.expand_as(delta), 0.0)
        kept_tok = w != 0
    if cfg.masks or cfg.weight == "mis":
        metrics["rollout/masked_token_frac"] = 1.0 - _masked(kept_tok.double(), mask).mean()
        metrics["rollout/masked_row_frac"] = 1.0 - kept_tok.any(-1)[rows].double().mean()
    return w.float(), metrics


def _within(log_ratio: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    """``log_ratio`` in [log low, log high] (low = 0: no lower bound); NaN is outside (dropped, not kept)."""
    lo, hi = bounds
    return (log_ratio >= math.log(lo) if lo > 0 else ~torch.isnan(log_ratio)) & (log_ratio <= math.log(hi))
