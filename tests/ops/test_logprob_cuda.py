"""The fused log-prob op on CUDA against the fp64 reference (marked gpu: skipped without a CUDA device).

Ran on an H100 on 2026-11-25 and an H200 on 2026-11-26 (all passed; docs/benchmarks.md). Same checks as the CPU tests:
fp32 relative error < 1e-5, bf16 at most 2x torch's own bf16 error, temperature and entropy, unaligned
rows (odd V, strided views), in-place backward, batch invariance.
"""

import pytest
import torch
from _logprob_helpers import fused, make_case, max_err, oracle, rel_err, torch_naive, upstream

from pacs_megatron.ops import ext_available, fused_logprobs

pytestmark = [pytest.mark.gpu]

SHAPES = [(2, 3, 5), (3, 4, 1001), (2, 5, 4099), (2, 3, 32003)]


@pytest.fixture(autouse=True)
def _needs_cuda_build():
    if not ext_available("cuda"):
        pytest.fail("pacs_megatron._C was built without CUDA on a machine with a GPU: rebuild with PACS_BUILD_CUDA=1")


def _cpu(res):
    return tuple(None if r is None else r.cpu() for r in res)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cuda_fp32(shape, temperature):
    logits, targets, mask = make_case(shape, torch.float32, seed=31, device="cuda")
    w = upstream(shape, 31, device="cuda")
    got = _cpu(fused(logits, targets, mask, w, temperature=temperature, return_entropy=True))
    ref = _cpu(oracle(logits, targets, mask, w, temperature=temperature, return_entropy=True))
    for name, a, r in zip(("token_logp", "seq_logp", "entropy", "grad"), got, ref):
        assert rel_err(a, r) < 1e-5, name


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cuda_bf16_within_2x_torch(shape, temperature):
    logits, targets, mask = make_case(shape, torch.bfloat16, seed=37, device="cuda")
    w = upstream(shape, 37, device="cuda")
    got = _cpu(fused(logits, targets, mask, w, temperature=temperature))
    ref = _cpu(oracle(logits, targets, mask, w, temperature=temperature))
    base = _cpu(torch_naive(logits, targets, mask, w, temperature=temperature))
    for name, i in (("token_logp", 0), ("seq_logp", 1), ("grad", 3)):
        assert max_err(got[i], ref[i]) <= 2 * max_err(base[i], ref[i]) + 1e-6, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_strided_and_inplace(dtype):
    full, targets, mask = make_case((3, 9, 1003), dtype, seed=41, device="cuda")
    w = upstream((3, 8), 41, device="cuda")
    x, t, m = full[:, :-1], targets[:, 1:], mask[:, 1:]
    base = _cpu(fused(x.contiguous(), t, m, w, temperature=0.8, return_entropy=True))
    strided = _cpu(fused(x, t, m, w, temperature=0.8, return_entropy=True))
    inplace = _cpu(fused(x.contiguous(), t, m, w, temperature=0.8, return_entropy=True, inplace_backward=True))
    for i, (a, b, c) in enumerate(zip(base, strided, inplace)):
        assert torch.equal(a, c)  # same layout: in-place changes nothing numerically
        # strided rows are aligned differently from the copy's, so the reduction split (last bits) may differ
        assert rel_err(b, a) < (1e-5 if i < 3 or dtype == torch.float32 else 1e-2)
    leaf = x.contiguous().requires_grad_()
    y = leaf * 2.0
    fused_logprobs(y, t, m, inplace_backward=True, impl="ext").seq_logp.sum().backward()
    assert torch.equal(y.detach(), leaf.grad / 2)


def test_cuda_matches_cpu_and_batch_invariant():
    # V * 4 bytes is a multiple of 16: every row has the same alignment, hence the same thread/element split
    # (rows aligned differently split differently and may differ in the last bit)
    logits, targets, mask = make_case((1, 24, 5004), torch.float32, seed=43)
    cpu = fused_logprobs(logits, targets, mask, return_entropy=True, impl="ext")
    gpu = fused_logprobs(logits.cuda(), targets.cuda(), mask.cuda(), return_entropy=True, impl="ext")
    assert rel_err(gpu.token_logp.cpu().double(), cpu.token_logp.double()) < 1e-5
    part = fused_logprobs(logits[:, 5:9].cuda(), targets[:, 5:9].cuda(), impl="ext")
    assert torch.equal(part.token_logp, gpu.token_logp[:, 5:9])
