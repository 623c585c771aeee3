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
from _logprob_helpers import needs_ext

from pacs_megatron.ops import fused_head_logprobs, fused_logprobs, reference_logprobs

B, T, H, V = 3, 7, 24, 203  # V odd: blocks of 64 columns leave a ragged last block


def _case(dtype, seed=0, vocab=V):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, H, generator=gen, dtype=torch.float64) * 0.4).to(dtype)
    targets = torch.randint(0, vocab, (B, T), generator=gen)
    targets[0, -1] = -100  # an ignored position: logp 0, no gradient
    mask = torch.rand(B, T, generator=gen) > 0.3
    ups = (torch.randn(B, T, generator=gen), torch.randn(B, generator=gen), torch.randn(B, T, generator=gen))
    return hidden, weight, targets, mask, ups


def _loss(out, ups):
    w_tok, w_seq, w_ent = ups
    loss = (out.token_logp * w_tok.to(out.token_logp.dtype)).sum() + (out.seq_logp * w_seq.to(out.seq_logp.dtype)).sum()
    if out.entropy is not None:
        loss = loss + (out.entropy * w_ent.to(out.entropy.dtype)).sum()
    return loss


def _pad_mask(logits, vocab_size):
    if vocab_size is None or vocab_size == logits.size(-1):
        return logits
    pad = torch.arange(logits.size(-1)) >= vocab_size
    return logits.masked_fill(pad, -1e30)


def _run(kind, hidden, weight, targets, mask, ups, *, temperature, entropy, vocab_size=None, block=64, impl="ext"):
    """(token_logp, seq_logp, entropy, grad_hidden, grad_weight) as fp64, for the fused op / unfused / oracle."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    kw = dict(temperature=temperature, return_entropy=entropy)
    if kind == "fused":
        out = fused_head_logprobs(h, w, targets, mask, vocab_size=vocab_size, block_cols=block, impl=impl, **kw)
    elif kind == "unfused":
        out = fused_logprobs(_pad_mask(h @ w.t(), vocab_size), targets, mask, impl="ext", **kw)
    else:
        out = reference_logprobs(_pad_mask(h @ w.t(), vocab_size), targets, mask, compute_dtype=torch.float64, **kw)
    _loss(out, ups).backward()
    ent = out.entropy.detach().double() if entropy else torch.zeros(1, dtype=torch.float64)
    return [out.token_logp.detach().double(), out.seq_logp.detach().double(), ent, h.grad.double(), w.grad.double()]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@needs_ext
@pytest.mark.parametrize("impl", ["ext", "reference"])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("temperature,vocab_size,block", [(1.0, None, 64), (0.7, 190, 5), (1.3, None, 512)])
def test_fp32_equals_unfused(impl, entropy, temperature, vocab_size, block):
    case = _case(torch.float32, seed=int(temperature * 10) + block)
    kw = dict(temperature=temperature, entropy=entropy, vocab_size=vocab_size)
    got = _run("fused", *case, block=block, impl=impl, **kw)
    unfused = _run("unfused", *case, **kw)
    oracle = _run("oracle", *[x.double() if x.is_floating_point() else x for x in case[:2]], *case[2:], **kw)
    names = ("token_logp", "seq_logp", "entropy", "grad_hidden", "grad_weight")
    for name, g, u, o in zip(names, got, unfused, oracle):
        assert _rel(g, u) < 1e-5, f"{name}: vs unfused {_rel(g, u)}"
        assert _rel(g, o) < 1e-5, f"{name}: vs fp64 {_rel(g, o)}"
    assert got[0][0, -1] == 0 and got[0].ne(0).sum() == B * T - 1  # the ignored target, and nothing else


@needs_ext
@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_bf16_within_twice_unfused_error(impl):
    case = _case(torch.bfloat16, seed=3)
    kw = dict(temperature=0.9, entropy=True, vocab_size=200)
    got = _run("fused", *case, block=48, impl=impl, **kw)
    unfused = _run("unfused", *case, **kw)
    oracle = _run("oracle", case[0].double(), case[1].double(), *case[2:], **kw)
    names = ("token_logp", "seq_logp", "entropy", "grad_hidden", "grad_weight")
    for name, g, u, o in zip(names, got, unfused, oracle):
        err, own = _rel(g, o), _rel(u, o)
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
    hidden, weight, targets, mask, ups = _case(torch.float32, seed=11)
    outs = [fused_head_logprobs(hidden, weight, targets, block_cols=c, impl="ext").token_logp for c in (1, 7, 256)]
    for o in outs[1:]:
        assert _rel(o.double(), outs[0].double()) < 1e-6


@needs_ext
def test_no_grad_pass_and_weight_only_grad():
    hidden, weight, targets, mask, ups = _case(torch.float32, seed=5)
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
