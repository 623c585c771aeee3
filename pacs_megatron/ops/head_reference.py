"""Pure-torch, blocked twin of the fused LM-head op's C++ entry points (``csrc/head.cpp``).

The same three functions with the same signatures as ``pacs_megatron._C``'s ``head_partial``,
``logprob_combine`` and ``head_backward``, so the one autograd wrapper (``ops/head.py``) runs either:
the fallback where the extension is missing, and a readable statement of what the C++ computes.
Like the C++, it holds at most one ``[N, Vc]`` block of logits (plus its fp32 temporaries) at a time:

    forward, per block k of Vc vocab columns:  z = hidden @ weight[k]^T  (padded columns -> -1e30), x = z / T
        m = max x,  s = sum e,  tz = x_target (0 if not in the block),  a = sum e (x - m),  e = exp(x - m)
    combine (per row, over the W * K blocks' stats of every TP rank; see csrc/logprob.h combine_row):
        M = max m_r,  S = sum e^{m_r - M} s_r,  A = sum e^{m_r - M} (a_r + (m_r - M) s_r)
        logp = sum tz_r - (M + log S),   H = log S - A / S
    backward, per block: recompute x, p = exp(x - lse),
        g = [g_lp (onehot - p) - g_H p (log p + H)] / T   (rows without upstream gradient: exact 0)
        grad_weight[k] = g^T @ hidden,   grad_hidden += g @ weight[k]  (fp32 accumulator for bf16/fp16)

The oracle of the tests is not this file but the unfused path (``hidden @ weight.T`` then
``ops.reference_logprobs`` in fp64), which shares none of this code.

Legend: N rows, H hidden size, V = V_local (this rank's vocab shard), Vc columns per block, K blocks,
W tp world size.
"""

from __future__ import annotations

import torch

PAD_LOGIT = -1e30
"""Logit of a padded vocab column (actor/model.py mask_padded_vocab uses the same; fp16: its lowest value)."""


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_logits(hidden: torch.Tensor, weight: torch.Tensor, v0: int, c: int, valid_local: int) -> torch.Tensor:
    """``[N, c]`` logits of vocab columns ``[v0, v0 + c)`` in the hidden states' dtype, padded columns masked."""
    z = hidden @ weight[v0 : v0 + c].t()
    real = max(0, min(c, valid_local - v0))
    if real < c:
        z[:, real:] = -65504.0 if z.dtype == torch.float16 else PAD_LOGIT
    return z


def head_partial(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    inv_temp: float,
    with_entropy: bool,
    valid_local: int,
    block: int,
) -> torch.Tensor:
    """``[K, N, 4]`` (m, s, tz, a) of each vocab block of this shard, fp32 (fp64 for fp64 inputs)."""
    n, vocab = hidden.size(0), weight.size(0)
    vc = min(block, vocab)
    starts = range(0, vocab, vc)
    stats = torch.zeros((len(starts), n, 4), dtype=_acc(hidden.dtype), device=hidden.device)
    for k, v0 in enumerate(starts):
        c = min(vc, vocab - v0)
        x = block_logits(hidden, weight, v0, c, valid_local).to(stats.dtype) * inv_temp
        m = x.amax(dim=-1)
        shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf: s = 0, no -inf - -inf
        e = torch.exp(x - shift.unsqueeze(-1))
        local = targets - vocab_start - v0
        is_local = (local >= 0) & (local < c)
        tz = x.gather(-1, local.clamp(0, c - 1).unsqueeze(-1)).squeeze(-1)
        stats[k, :, 0] = m
        stats[k, :, 1] = e.sum(dim=-1)
        stats[k, :, 2] = torch.where(is_local, tz, torch.zeros_like(tz))
        if with_entropy:
            d = x - shift.unsqueeze(-1)
            stats[k, :, 3] = (e * torch.where(e > 0, d, torch.zeros_like(d))).sum(dim=-1)
    return stats


def logprob_combine(stats: torch.Tensor, targets: torch.Tensor, vocab_global: int) -> torch.Tensor:
    """``[S, N, 4]`` gathered stats of S shards or blocks -> ``[N, 3]`` (logp, lse, entropy); shards with s == 0
    are skipped (no mass), a NaN s is kept (a NaN row stays NaN), as ``combine_row`` in csrc/logprob.h."""
    m, s, tz, a = stats.unbind(dim=-1)
    big = m.amax(dim=0)
    keep = s != 0
    d = torch.where(keep, m - big, torch.zeros_like(m))
    f = torch.exp(d)
    total = torch.where(keep, f * s, torch.zeros_like(s)).sum(dim=0)
    ent = torch.where(keep, f * (a + d * s), torch.zeros_like(s)).sum(dim=0)
    log_sum = torch.log(total)
    lse = big + log_sum
    valid = (targets >= 0) & (targets < vocab_global)
    logp = torch.where(valid, tz.sum(dim=0) - lse, torch.zeros_like(lse))
    return torch.stack([logp, lse, log_sum - ent / total], dim=-1)


def head_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    rowp: torch.Tensor,
    vocab_start: int,
    inv_temp: float,
    with_entropy: bool,
    valid_local: int,
    block: int,
    grad_hidden: torch.Tensor,
) -> torch.Tensor:
    """Writes this shard's d loss / d hidden into ``grad_hidden``; returns d loss / d weight.
    ``rowp`` ``[N, 4]``: (lse, g_logp, g_entropy, entropy) per row."""
    vocab = weight.size(0)
    acc = _acc(hidden.dtype)
    vc = min(block, vocab)
    grad_weight = torch.empty_like(weight)
    gh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
    lse, g_lp, g_h, ent = (col.unsqueeze(-1) for col in rowp.unbind(dim=-1))
    silent = (g_lp == 0) & (g_h == 0)  # no upstream gradient: exact 0, even for a NaN row
    rows = torch.arange(hidden.size(0), device=hidden.device)
    for v0 in range(0, vocab, vc):
        c = min(vc, vocab - v0)
        x = block_logits(hidden, weight, v0, c, valid_local).to(acc) * inv_temp
        lp = x - lse
        p = torch.exp(lp)
        g = -p * g_lp
        if with_entropy:
            g = g - p * g_h * (lp.clamp_min(-1000.0) + ent)  # clamp: no 0 * -inf where p == 0
        local = targets - vocab_start - v0
        hit = (local >= 0) & (local < c)
        g[rows[hit], local[hit]] += g_lp.squeeze(-1)[hit]
        g = g * inv_temp
        g[:, max(0, min(c, valid_local - v0)) :] = 0  # padded columns are constants (mask_padded_vocab)
        g = torch.where(silent, torch.zeros_like(g), g).to(hidden.dtype)
        grad_weight[v0 : v0 + c] = g.t() @ hidden
        gh += (g @ weight[v0 : v0 + c]).to(acc)
    grad_hidden.copy_(gh)
    return grad_weight
