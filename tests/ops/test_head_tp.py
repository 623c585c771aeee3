"""The fused LM head + log-prob op under tensor parallelism (TP=2, gloo), with and without sequence parallelism.

Each rank holds its vocab rows of the output weight (megatron's layout: rank r owns ids [r V_local, ...)) and
the check is against the unsharded unfused path on the full weight (``hidden @ W.T`` then ``fused_logprobs``):
values, grad_hidden (after the op's TP all-reduce: the full gradient on every rank, as megatron's
ColumnParallelLinear gives its input) and each rank's grad_weight rows. Padded vocab (the last rank's tail)
included. Exactly one collective runs in forward (the [N, 4] stats all-gather) and one in backward (the
grad_hidden all-reduce).

Sequence parallelism: megatron's SP needs Transformer Engine or Apex, neither of which runs on CPU, so the
actor does not use it here. The op's SP contract is checked directly: each rank holds a slice of the
sequence, gathers it with an all-gather whose backward reduce-scatters (what megatron's
``gather_from_sequence_parallel_region(tensor_parallel_output_grad=True)`` does), and calls the op with
``reduce_grad_input=False``; its slice's gradient must equal the matching rows of the unsharded gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from test_logprob_tp import CollectiveCounter

from pacs_megatron.ops import fused_head_logprobs, fused_logprobs


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 in forward; reduce-scatter (sum, keep own rows) in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)  # gloo: all-reduce + slice is the reduce-scatter
        n = g.size(0) // dist.get_world_size(ctx.group)
        r = dist.get_rank(ctx.group)
        return g[r * n : (r + 1) * n], None


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _check(rank: int, world: int, dtype) -> dict:
    group = dist.new_group(list(range(world)))
    gen = torch.Generator().manual_seed(5)  # the same full tensors on every rank
    n, h, v_local, vocab_size, temp = 12, 16, 37, 70, 0.8  # 2 * 37 = 74 ids, 70 real: rank 1 holds 4 padded
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(world * v_local, h, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    targets = torch.randint(0, vocab_size, (n,), generator=gen)
    w_tok, w_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    lo, hi = rank * v_local, (rank + 1) * v_local

    def loss(out):
        return (out.token_logp * w_tok).sum() + (out.entropy * w_ent).sum()

    # the unsharded unfused path: full logits, padded columns masked as actor/model.py does
    hf, wf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = (hf @ wf.t()).masked_fill(torch.arange(world * v_local) >= vocab_size, -1e30)
    want = fused_logprobs(logits, targets, temperature=temp, return_entropy=True, impl="ext")
    loss(want).backward()

    res = {}
    for impl in ("ext", "reference"):
        hs, ws = hidden.clone().requires_grad_(), weight[lo:hi].clone().requires_grad_()
        kw = dict(temperature=temp, tp_group=group, return_entropy=True, vocab_size=vocab_size, block_cols=16)
        with CollectiveCounter() as fwd:
            got = fused_head_logprobs(hs, ws, targets, impl=impl, **kw)
        with CollectiveCounter() as bwd:
            loss(got).backward()
        # sequence parallel: this rank's rows only, gathered with a reduce-scattering backward
        rows = n // world
        hp = hidden[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        wp = weight[lo:hi].clone().requires_grad_()
        sp = fused_head_logprobs(_GatherSeq.apply(hp, group), wp, targets, impl=impl, reduce_grad_input=False, **kw)
        loss(sp).backward()
        res[impl] = {
            "fwd": fwd.calls,
            "bwd": bwd.calls,
            "values": max(_rel(got.token_logp, want.token_logp), _rel(got.entropy, want.entropy)),
            "grad_hidden": _rel(hs.grad, hf.grad),
            "grad_weight": _rel(ws.grad, wf.grad[lo:hi]),
            "sp_values": _rel(sp.token_logp, want.token_logp),
            "sp_grad_hidden": _rel(hp.grad, hf.grad[rank * rows : (rank + 1) * rows]),
            "sp_grad_weight": _rel(wp.grad, wf.grad[lo:hi]),
        }
    return res


def _body(rank: int, world: int) -> dict:
    return {str(dt): _check(rank, world, dt) for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.distributed
def test_fused_head_tp2_and_sequence_parallel():
    for rank, by_dtype in enumerate(run_distributed(_body, 2)):
        for dt, by_impl in by_dtype.items():
            fp32 = dt == "torch.float32"
            for impl, r in by_impl.items():
                where = f"rank {rank} {dt} {impl}"
                assert r["fwd"] in (["all_gather_single"], ["all_gather_into_tensor"]), f"{where}: {r['fwd']}"
                assert r["bwd"] == ["all_reduce"], f"{where}: backward collectives {r['bwd']}"
                for key in ("values", "sp_values"):
                    assert r[key] < (1e-5 if fp32 else 2e-2), f"{where} {key}: {r[key]}"
                for key in ("grad_hidden", "grad_weight", "sp_grad_hidden", "sp_grad_weight"):
                    assert r[key] < (1e-5 if fp32 else 3e-2), f"{where} {key}: {r[key]}"
