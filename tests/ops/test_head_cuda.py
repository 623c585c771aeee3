"""The fused LM head + log-prob op (ops/head.py, csrc/head.cpp) on CUDA (marked gpu: skipped without a device).

The CPU tests' checks on CUDA tensors, where the row kernels are csrc/head.cpp's ``partial_cuda`` /
``backward_cuda`` and the GEMMs cuBLAS: fp32 within 1e-5 relative of the unfused path and of the fp64 oracle;
bf16 at most 2x the unfused path's own error; fp64 gradcheck; the block width changes nothing but rounding;
a shape with many blocks and a vocabulary like Qwen's (odd width, padded columns).

All passed on an H200, 2026-11-28 (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest
import torch
from _head_helpers import NAMES, make_head_case, rel, run_head, run_oracle

from pacs_megatron.ops import ext_available, fused_head_logprobs

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _needs_cuda_build():
    if not ext_available("cuda"):
        pytest.fail("pacs_megatron._C was built without CUDA on a machine with a GPU: rebuild with PACS_BUILD_CUDA=1")


@pytest.mark.parametrize("impl", ["ext", "reference"])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize(
    "temperature,vocab,vocab_size,block,shape",
    [(1.0, 203, None, 64, (3, 7, 24)), (0.7, 203, 190, 5, (3, 7, 24)), (1.0, 4099, 4090, 1024, (4, 33, 96))],
)
def test_cuda_fp32_equals_unfused(impl, entropy, temperature, vocab, vocab_size, block, shape):
    case = make_head_case(torch.float32, seed=block + vocab, vocab=vocab, device="cuda", shape=shape)
    kw = dict(temperature=temperature, entropy=entropy, vocab_size=vocab_size)
    got = run_head("fused", *case, block=block, impl=impl, **kw)
    unfused = run_head("unfused", *case, **kw)
    oracle = run_oracle(*case, **kw)
    for name, g, u, o in zip(NAMES, got, unfused, oracle):
        assert rel(g, u) < 1e-5, f"{name}: vs unfused {rel(g, u)}"
        assert rel(g, o) < 1e-5, f"{name}: vs fp64 {rel(g, o)}"


@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_cuda_bf16_within_twice_unfused_error(impl):
    case = make_head_case(torch.bfloat16, seed=3, vocab=4099, device="cuda", shape=(4, 33, 96))
    kw = dict(temperature=0.9, entropy=True, vocab_size=4090)
    got = run_head("fused", *case, block=512, impl=impl, **kw)
    unfused = run_head("unfused", *case, **kw)
    oracle = run_oracle(*case, **kw)
    for name, g, u, o in zip(NAMES, got, unfused, oracle):
        err, own = rel(g, o), rel(u, o)
        assert err <= 2 * own + 1e-6, f"{name}: fused error {err} > 2x unfused error {own}"
        assert err < 3e-2, f"{name}: {err}"


def test_cuda_gradcheck_fp64():
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(5, 6, dtype=torch.float64, generator=gen).cuda().requires_grad_()
    w = torch.randn(11, 6, dtype=torch.float64, generator=gen).cuda().requires_grad_()
    tgt = torch.tensor([0, 3, 10, -100, 9], device="cuda")

    def fn(h, w):
        out = fused_head_logprobs(h, w, tgt, temperature=0.8, return_entropy=True, block_cols=4, impl="ext")
        return out.token_logp, out.entropy

    assert torch.autograd.gradcheck(fn, (h, w), eps=1e-6, atol=1e-7)


def test_cuda_block_width_and_device_agree():
    """Block widths 1, 7, 256 and the CPU op give the same log-probs up to fp32 rounding."""
    hidden, weight, targets, mask, _ = make_head_case(torch.float32, seed=11, device="cuda")
    outs = [fused_head_logprobs(hidden, weight, targets, block_cols=c, impl="ext").token_logp for c in (1, 7, 256)]
    cpu = fused_head_logprobs(hidden.cpu(), weight.cpu(), targets.cpu(), impl="ext").token_logp
    for o in outs[1:] + [cpu]:
        assert rel(o.double().cpu(), outs[0].double().cpu()) < 1e-6
