"""The two all-gathers of context parallelism, as autograd functions over the CP group.

Both concatenate the CP ranks' chunks along ``dim`` in rank order (parallel/cp_split.py ``unsplit_sequence``
puts them back in sequence order); they differ in who reads the result, hence in their backward:

* :func:`gather_for_attention` (K and V in actor/attention.py): each rank uses the gathered tensor in its
  own computation (its queries), so the gradient of a rank's chunk is the sum of every rank's gradient for
  it (an all-reduce, then this rank's slice).
* :func:`gather_replicated` (the per-token log-probs, actor/forward.py): every rank computes the same loss
  from the gathered tensor, so each rank's gradient already is the whole gradient; backward keeps this
  rank's slice (as TP's reductions in ops/reference.py: identity where every rank sees the same upstream).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((world * src.shape[0], *src.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 renamed it
    gather(out, src, group=group)
    return out.movedim(0, dim)


def _own_slice(grad: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = grad.shape[dim] // dist.get_world_size(group)
    return grad.narrow(dim, dist.get_rank(group) * n, n).contiguous()


class _Gather(torch.autograd.Function):
    """All-gather along ``dim``; backward keeps this rank's slice of the gradient, summed over the ranks first
    when ``reduce`` (each rank's gradient is a different part) and as it is otherwise (every rank's is the same)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int, reduce: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.reduce = group, dim, reduce
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce:
            grad = grad.contiguous()
            # gloo has no reduce-scatter: all-reduce the whole gradient and keep this rank's slice
            dist.all_reduce(grad, group=ctx.group)
        return _own_slice(grad, ctx.group, ctx.dim), None, None, None


def gather_for_attention(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """All CP ranks' chunks of ``x`` along ``dim`` in rank order; backward sums the ranks' gradients."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _Gather.apply(x, group, dim, True)


def gather_replicated(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """All CP ranks' chunks of ``x`` along ``dim`` in rank order, for a computation every rank repeats
    identically; backward keeps this rank's slice of the (identical) gradient."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _Gather.apply(x, group, dim, False)
