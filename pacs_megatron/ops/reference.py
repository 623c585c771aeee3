"""Pure-torch reference of the (vocab-parallel) log-prob op: test oracle, fallback and benchmark baseline.

Computes, per row of ``z = logits / temperature`` over the full (possibly sharded) vocabulary,

    lse     = log sum_v exp(z_v)                 (max-shifted; max and sum all-reduced over tp_group)
    logp    = z_target - lse                     (0 where target is outside [0, V_global))
    entropy = -sum_v p_v log p_v = log S - A / S,  S = sum_v e_v,  A = sum_v e_v (z_v - max),  e = exp(z - max)
    seq     = sum_t where(mask, logp, 0)

in ``compute_dtype`` (float64 for oracles). Autograd flows through plain torch ops; the two sums
that cross shards go through ``_ReduceFromTP`` (forward all-reduce, backward identity, as Megatron's
``reduce_from_tensor_model_parallel_region``), so each rank's gradient is that of its own shard. The
max is a constant shift (lse does not depend on it), so it is all-reduced detached. It uses 3-4
collectives per forward and materialises several [N, V] temporaries: it is meant to be obviously
correct, not fast (see ``ops/logprob.py`` for the fused op).

Legend: B, T leading dims; V = V_local vocab shard; W = tp world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pacs_megatron.ops.types import LogprobOutput


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) over the TP group in forward; identity in backward (every rank sees the same upstream)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def tp_world_and_rank(tp_group) -> tuple[int, int]:
    """(world size, rank) of ``tp_group``; (1, 0) for None or when torch.distributed is not initialised."""
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def reference_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    tp_group=None,
    return_entropy: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> LogprobOutput:
    """Reference log-probs; same contract as ``pacs_megatron.ops.fused_logprobs``.

    Args:
        logits: [B, T, V] or [N, V], this rank's contiguous vocab shard (any float dtype, any strides).
        targets: [B, T] or [N] int64 global token ids.
        mask: optional bool (or 0/1) tensor shaped like targets; selects the positions summed into seq_logp.
        temperature: logits are divided by it before the softmax.
        tp_group: tensor-parallel process group the vocab is sharded over (None: unsharded).
        return_entropy: also return the per-token entropy.
        compute_dtype: float32 for the fallback, float64 for oracles (outputs come in this dtype).
    """
    world, rank = tp_world_and_rank(tp_group)
    z = logits.to(compute_dtype) / temperature
    vocab = z.size(-1)

    big = z.detach().amax(dim=-1)
    if world > 1:
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=tp_group)
    big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))  # all -inf rows: avoid -inf - -inf

    def tp_sum(x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(x, tp_group) if world > 1 else x

    shifted = z - big.unsqueeze(-1)
    e = torch.exp(shifted)
    sum_exp = tp_sum(e.sum(dim=-1))
    lse = big + torch.log(sum_exp)

    local = targets - rank * vocab
    is_local = (local >= 0) & (local < vocab)
    z_target = z.gather(-1, local.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    z_target = tp_sum(torch.where(is_local, z_target, torch.zeros_like(z_target)))
    valid = (targets >= 0) & (targets < world * vocab)
    token_logp = torch.where(valid, z_target - lse, torch.zeros_like(lse))

    seq_logp = None
    if mask is not None:
        seq_logp = torch.where(mask.bool(), token_logp, torch.zeros_like(token_logp)).sum(dim=-1)

    entropy = None
    if return_entropy:
        # H = log S - A / S with A = sum_v e_v (z_v - max): a function of the two all-reduced sums only, so the
        # identity backward of _ReduceFromTP gives each shard its full gradient (a per-shard sum of -p log p would
        # miss the other shards' dependence on lse).
        e_shift = e * torch.where(e > 0, shifted, torch.zeros_like(shifted))  # no 0 * -inf (value, grad) at -inf
        entropy = torch.log(sum_exp) - tp_sum(e_shift.sum(dim=-1)) / sum_exp
    return LogprobOutput(token_logp=token_logp, seq_logp=seq_logp, entropy=entropy)


def naive_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None, *, temperature: float = 1.0
) -> LogprobOutput:
    """The textbook unsharded path, ``log_softmax(logits / T).gather`` in the logits' dtype (benchmark baseline
    and the "torch's own bf16 error" yardstick of the tests). Targets must be valid local ids."""
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    seq = None if mask is None else torch.where(mask.bool(), logp, torch.zeros_like(logp)).sum(dim=-1)
    return LogprobOutput(token_logp=logp, seq_logp=seq)
