"""TEMPORARY: ``fused_logprobs`` from ``pacs_megatron.ops`` when it exists, else a pure-torch fallback.

The real op (kernels + TP all-reduces) is being written in ``pacs_megatron/ops``; delete the fallback
below once ``from pacs_megatron.ops import fused_logprobs`` works everywhere. Contract (both):

    fused_logprobs(logits [B, T, V_local], targets [B, T], mask=None [B, T], temperature=1.0,
                   tp_group=None, return_entropy=False)
      -> record with .token_logp [B, T] float32, .seq_logp [B] (when mask given), .entropy [B, T]
         (when return_entropy)

``logits`` is this TP rank's contiguous vocabulary shard (rows ``tp_rank * V_local ...``),
``targets`` are global token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

try:  # pragma: no cover - depends on the ops package being present
    from pacs_megatron.ops import fused_logprobs
except ImportError:  # TEMPORARY fallback, remove with the ops package
    fused_logprobs = None


@dataclass(frozen=True)
class _LogprobRecord:
    token_logp: torch.Tensor
    seq_logp: torch.Tensor | None
    entropy: torch.Tensor | None


def _reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    """All-reduce forward, identity backward (every TP rank computes the same loss from the result)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if op == dist.ReduceOp.SUM:
        return reduce_from_tensor_model_parallel_region(x, group=group)
    x = x.detach().clone()
    dist.all_reduce(x, op=op, group=group)
    return x


def _fallback_logprobs(logits, targets, mask=None, temperature=1.0, tp_group=None, return_entropy=False):
    """Vocab-parallel log-softmax gather in fp32 (max and sum-exp all-reduced over ``tp_group``)."""
    x = logits.float() / temperature  # [B, T, V_local]
    v_local = x.shape[-1]
    rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    m = _reduce(x.detach().amax(dim=-1), dist.ReduceOp.MAX, tp_group)  # [B, T]
    shifted = x - m.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, tp_group)  # [B, T]
    local = targets - rank * v_local
    inside = (local >= 0) & (local < v_local)
    picked = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _reduce(torch.where(inside, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, tp_group)
    log_z = sum_exp.log()
    token_logp = target_logit - log_z
    seq_logp = None
    if mask is not None:
        seq_logp = (token_logp * mask.to(token_logp.dtype)).sum(dim=-1)
    entropy = None
    if return_entropy:
        with torch.no_grad():
            p_x = _reduce((exp * shifted).sum(dim=-1), dist.ReduceOp.SUM, tp_group)
            entropy = log_z - p_x / sum_exp
    return _LogprobRecord(token_logp, seq_logp, entropy)


if fused_logprobs is None:
    fused_logprobs = _fallback_logprobs

__all__ = ["fused_logprobs"]
