"""The fused LM head's benchmark rows (bench/head.py) compare like with like: every candidate computes the same
loss and the same gradients of hidden and weight, and a row reports time, peak memory and vocab buffers a token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pacs_megatron.bench.head import HEAD_CANDIDATES, bench_head_shape, head_candidate
from pacs_megatron.bench.logprob import _PeakMemory


def test_candidates_agree_on_loss_and_gradients():
    gen = torch.Generator().manual_seed(0)
    n, v, h = 40, 300, 32
    hidden = torch.randn(1, n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    targets = torch.randint(0, v, (1, n), generator=gen)
    mask = torch.rand(1, n, generator=gen) > 0.2
    results = {}
    for name in HEAD_CANDIDATES:
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = head_candidate(name, 0.9, block_cols=64)(hh, ww, targets, mask)
        results[name] = (loss.detach(), *torch.autograd.grad(loss, [hh, ww]))
    want = results["head+naive"]
    for name, got in results.items():
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), name


def test_row_reports_time_memory_and_vocab_buffers():
    args = SimpleNamespace(
        head_candidates="head-fused,head+naive", temperature=1.0, block_cols=128, repeat=1, dtype="float32"
    )
    row = bench_head_shape(32, 512, 16, args, torch.device("cpu"), torch.float32, _PeakMemory)
    assert set(row["candidates"]) == {"head-fused", "head+naive"}
    for res in row["candidates"].values():
        assert res["fwd_ms"] > 0 and res["fwd_bwd_ms"] > 0
        assert res["fwd_bwd_vocab_buffers_per_token"] == pytest.approx(
            res["fwd_bwd_peak_extra_mb"] * 2**20 / (32 * 512 * 4)
        )
    assert row["speedup_vs_head+naive"]["fwd"] > 0
