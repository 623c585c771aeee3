"""The CP all-gathers' backwards (parallel/cp_comm.py) and actor/attention.py's CP path, against one process.

One 2-rank launch: each check compares values and gradients with the same computation done whole.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _dist import run_distributed

S, B, H, G, D = 12, 2, 4, 2, 8


def _attention(cp_group):
    from pacs_megatron.actor.attention import SDPACoreAttention

    attn = SDPACoreAttention.__new__(SDPACoreAttention)
    torch.nn.Module.__init__(attn)  # the forward's state only: no megatron config needed
    attn.heads, attn.kv_heads, attn.scale, attn.cp_group = H, G, D**-0.5, cp_group
    return attn


def _comm_body(rank, world):
    import torch.distributed as dist

    from pacs_megatron.parallel.cp_comm import gather_for_attention, gather_replicated
    from pacs_megatron.parallel.cp_split import chunk_positions, thd_chunk_index

    group = dist.new_group(list(range(world)))
    out = {}
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(world, 3, 4, generator=g, dtype=torch.float64)
    w_all = torch.randn(world, 3, world * 4, generator=g, dtype=torch.float64)
    # K/V-style: every rank uses the gathered tensor in its own loss; the total loss is their sum
    x = x_all[rank].clone().requires_grad_()
    (gather_for_attention(x, group, dim=1) * w_all[rank]).sum().backward()
    out["attn_grad"] = (x.grad, w_all.sum(0)[:, rank * 4 : (rank + 1) * 4])
    # log-prob-style: every rank computes the same loss from the gathered tensor
    x = x_all[rank].clone().requires_grad_()
    y = gather_replicated(x, group, dim=1)
    torch.testing.assert_close(y, torch.cat(list(x_all), dim=1))
    (y.sin() * w_all[0]).sum().backward()
    full = torch.cat(list(x_all), dim=1)
    out["repl_grad"] = (x.grad, (full.cos() * w_all[0])[:, rank * 4 : (rank + 1) * 4])

    # attention: this rank's zig-zag chunks vs whole-sequence causal attention, values and gradients
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(S, B, n, D, generator=g).to(dtype) for n in (H, G, G))
        w = torch.randn(S, B, H * D, generator=g).to(dtype)
        full_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = _attention(None)(*full_in, None)
        (ref.float() * w.float()).sum().backward()
        pos = chunk_positions(S, world, rank)
        local = [t[pos].clone().requires_grad_() for t in (q, k, v)]
        got = _attention(group)(*local, None)
        # the total loss is the sum over ranks of each rank's queries
        (got.float() * w[pos].float()).sum().backward()
        out[f"attn_{dtype}"] = (
            (got.float() - ref[pos].float()).abs().max().item(),
            max((a.grad.float() - b.grad[pos].float()).abs().max().item() for a, b in zip(local, full_in)),
            tol,
        )

    # THD: three packed segments (each a multiple of 2 * cp), this rank's chunks of each vs the whole packing
    cu = torch.tensor([0, 4, 12, 16], dtype=torch.int32)
    packed = SimpleNamespace(cu_seqlens_q=cu)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(16, n, D, generator=g) for n in (H, G, G))
    w = torch.randn(16, H, D, generator=g)
    full_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _attention(None)(*full_in, None, packed_seq_params=packed)
    (ref * w).sum().backward()
    pos = thd_chunk_index(cu, world, rank)
    local = [t[pos].clone().requires_grad_() for t in (q, k, v)]
    got = _attention(group)(*local, None, packed_seq_params=packed)
    (got * w[pos]).sum().backward()
    out["thd"] = (
        (got - ref[pos]).abs().max().item(),
        max((a.grad - b.grad[pos]).abs().max().item() for a, b in zip(local, full_in)),
    )
    return out


@pytest.mark.distributed
def test_cp_gathers_and_attention_match_one_process():
    for r in run_distributed(_comm_body, 2):
        torch.testing.assert_close(*r["attn_grad"])
        torch.testing.assert_close(*r["repl_grad"])
        for dtype in (torch.float32, torch.bfloat16):
            value, grad, tol = r[f"attn_{dtype}"]
            assert value <= tol and grad <= tol, (dtype, value, grad)
        assert max(r["thd"]) <= 2e-6, r["thd"]
