"""The fused LM head + log-prob op (ops/head.py, csrc/head.cpp) on CPU, TP = 1.

Every case is checked against the unfused path the actor runs without the switch: ``logits = hidden @ W.T``
(padded vocab columns masked as actor/model.py does) then ``fused_logprobs``, and against the fp64 oracle
(``reference_logprobs`` on the fp64 product). Gradients of hidden and weight included. fp32: within 1e-5
relative; bf16: the fused op's error vs fp64 at most 2x the unfused path's own error (both round the logits
to bf16; the fused op's grad_hidden sums its vocab blocks in fp32).
"""

from __future__ import annotations

import pytest
import torch
from _head_helpers import NAMES, B, T, make_head_case, rel, run_head, run_oracle
from _logprob_helpers import needs_ext

from pacs_megatron.ops import fused_head_logprobs


@needs_ext
@pytest.mark.parametrize("impl", ["ext", "reference"])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("temperature,vocab_size,block", [(1.0, None, 64), (0.7, 190, 5), (1.3, None, 512)])
def test_fp32_equals_unfused(impl, entropy, temperature, vocab_size, block):
    case = make_head_case(torch.float32, seed=int(temperature * 10) + block)
    kw = dict(temperature=temperature, entropy=entropy, vocab_size=vocab_size)
    got = run_head("fused", *case, block=block, impl=impl, **kw)
    unfused = run_head("unfused", *case, **kw)
    oracle = run_oracle(*case, **kw)
    for name, g, u, o in zip(NAMES, got, unfused, oracle):
        assert rel(g, u) < 1e-5, f"{name}: vs unfused {rel(g, u)}"
        assert rel(g, o) < 1e-5, f"{name}: vs fp64 {rel(g, o)}"
    assert got[0][0, -1] == 0 and got[0].ne(0).sum() == B * T - 1  # the ignored target, and nothing else


@needs_ext
@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_bf16_within_twice_unfused_error(impl):
    case = make_head_case(torch.bfloat16, seed=3)
    kw = dict(temperature=0.9, entropy=True, vocab_size=200)
    got = run_head("fused", *case, block=48, impl=impl, **kw)
    unfused = run_head("unfused", *case, **kw)
    oracle = run_oracle(*case, **kw)
    for name, g, u, o in zip(NAMES, got, unfused, oracle):
        err, own = rel(g, o), rel(u, o)
        assert err <= 2 * own + 1e-6, f"{name}: fused error {err} > 2x unfused error {own}"
        assert err < 3e-2, f"{name}: {err}"


@needs_ext
@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_gradcheck_fp64(impl):
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(5, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(11, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    tgt = torch.tensor([0, 3, 10, -100, 9])

    def fn(h, w):
        out = fused_head_logprobs(h, w, tgt, temperature=0.8, return_entropy=True, block_cols=4, impl=impl)
        return out.token_logp, out.entropy

    assert torch.autograd.gradcheck(fn, (h, w), eps=1e-6, atol=1e-7)


@needs_ext
def test_block_size_does_not_change_values():
    """The blocks merge like TP shards: the block width changes the summation order only (fp32 rounding)."""
    hidden, weight, targets, mask, ups = make_head_case(torch.float32, seed=11)
    outs = [fused_head_logprobs(hidden, weight, targets, block_cols=c, impl="ext").token_logp for c in (1, 7, 256)]
    for o in outs[1:]:
        assert rel(o.double(), outs[0].double()) < 1e-6


@needs_ext
def test_no_grad_pass_and_weight_only_grad():
    hidden, weight, targets, mask, ups = make_head_case(torch.float32, seed=5)
    with torch.no_grad():
        a = fused_head_logprobs(hidden, weight, targets, impl="ext").token_logp
    w = weight.clone().requires_grad_()
    b = fused_head_logprobs(hidden, w, targets, impl="ext").token_logp
    b.sum().backward()
    assert torch.equal(a, b.detach()) and w.grad is not None and torch.isfinite(w.grad).all()


def test_bad_arguments_name_the_argument():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="weight must be"):
        fused_head_logprobs(h, torch.randn(10, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="share one float dtype"):
        fused_head_logprobs(h, w.bfloat16(), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab_size"):
        fused_head_logprobs(h, w, torch.zeros(4, dtype=torch.long), vocab_size=11)
