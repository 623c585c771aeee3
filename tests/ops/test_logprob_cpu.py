"""The fused log-prob op on CPU against the fp64 reference: values, gradients, temperature, entropy,
masking, strided inputs, in-place backward, gradcheck, batch invariance and the impl switch.

fp64 runs on both paths (the C++ op accumulates in double for fp64 logits), so gradcheck exercises the
C++ backward formula itself; fp32/bf16/fp16 accumulate in fp32.
"""

import logging
import zlib

import pytest
import torch
from _logprob_helpers import fused, make_case, max_err, needs_ext, oracle, rel_err, torch_naive, upstream

from pacs_megatron.ops import fused_logprobs, reference_logprobs
from pacs_megatron.ops import logprob as logprob_mod

pytestmark = needs_ext

# V: 1 (trivial), 5 (tiny), 1001 / 4099 (not multiples of any vector width), 8195 (> the 2048-element block:
# several online rescales per row)
SHAPES = [(1, 1, 1), (2, 3, 5), (3, 4, 1001), (2, 5, 4099), (2, 4, 8195)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_matches_fp64_reference(shape, temperature):
    seed = zlib.crc32(repr((shape, temperature)).encode()) % 10_000
    logits, targets, mask = make_case(shape, torch.float32, seed=seed)
    w = upstream(shape, seed)
    got = fused(logits, targets, mask, w, temperature=temperature, return_entropy=True)
    ref = oracle(logits, targets, mask, w, temperature=temperature, return_entropy=True)
    names = ("token_logp", "seq_logp", "entropy", "grad")
    for name, a, r in zip(names, got, ref):
        # entropy is ~0 for V == 1: compare absolutely there
        err = max_err(a, r) if r.abs().max() < 1e-3 else rel_err(a, r)
        assert err < 1e-5, f"{name}: {err}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 3, 5), (3, 4, 1001), (2, 4, 8195)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_low_precision_within_2x_torch_error(dtype, shape, temperature):
    seed = zlib.crc32(repr((dtype, shape, temperature)).encode()) % 10_000
    logits, targets, mask = make_case(shape, dtype, seed=seed)
    w = upstream(shape, seed)
    got = fused(logits, targets, mask, w, temperature=temperature)
    ref = oracle(logits, targets, mask, w, temperature=temperature)
    base = torch_naive(logits, targets, mask, w, temperature=temperature)
    for name, i in (("token_logp", 0), ("seq_logp", 1), ("grad", 3)):
        ours, theirs = max_err(got[i], ref[i]), max_err(base[i], ref[i])
        assert ours <= 2 * theirs + 1e-6, f"{name}: fused err {ours} > 2 x torch {dtype} err {theirs}"


def test_grad_dtype_and_2d_input():
    logits, targets, mask = make_case((1, 6, 300), torch.bfloat16, seed=3)
    x = logits[0].detach().clone().requires_grad_()  # [N, V]
    out = fused_logprobs(x, targets[0], mask[0], impl="ext")
    assert out.token_logp.shape == (6,) and out.token_logp.dtype == torch.float32 and out.seq_logp.dim() == 0
    out.seq_logp.backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape
    ref = reference_logprobs(logits[0].double(), targets[0], mask[0], compute_dtype=torch.float64)
    assert rel_err(out.token_logp.double(), ref.token_logp) < 1e-5


@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_gradcheck_fp64(impl):
    logits, targets, mask = make_case((2, 3, 11), torch.float64, seed=5)
    targets[0, 1] = -100  # an ignored position: logp 0, no gradient
    x = logits.clone().requires_grad_()

    def fn(inp):
        out = fused_logprobs(inp, targets, mask, temperature=0.8, return_entropy=True, impl=impl)
        return out.token_logp, out.seq_logp, out.entropy

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)


def test_masked_positions_contribute_nothing():
    logits, targets, mask = make_case((3, 6, 777), torch.float32, seed=7, mask_p=0.5)
    other = logits.clone()
    other[~mask] = torch.randn_like(other[~mask]) * 50  # wildly different logits where masked
    outs = []
    for x in (logits, other):
        x = x.clone().requires_grad_()
        out = fused_logprobs(x, targets, mask, impl="ext")
        out.seq_logp.sum().backward()
        assert torch.all(x.grad[~mask] == 0), "masked rows got a gradient from seq_logp"
        outs.append((out.seq_logp.detach(), x.grad[mask]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    expected = (outs[0][0] * 0).clone()
    tok = fused_logprobs(logits, targets, impl="ext").token_logp
    for b in range(3):
        expected[b] = tok[b][mask[b]].sum()
    torch.testing.assert_close(outs[0][0], expected, rtol=1e-6, atol=1e-6)


def test_strided_inputs_match_contiguous_bitwise():
    full, targets, mask = make_case((3, 8, 1003), torch.bfloat16, seed=11)
    w = upstream((3, 7), 11)
    sliced = full[:, :-1]  # what the actor passes: logits for positions 0..T-2 (not contiguous)
    transposed = full.transpose(0, 1).contiguous().transpose(0, 1)[:, :-1]  # Megatron's [T, B, V] buffer
    base = fused(sliced.contiguous(), targets[:, 1:], mask[:, 1:], w, return_entropy=True)
    for x in (sliced, transposed):
        assert not x.is_contiguous()
        got = fused(x, targets[:, 1:], mask[:, 1:], w, return_entropy=True)
        for a, b in zip(got, base):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward(dtype):
    logits, targets, mask = make_case((2, 5, 2500), dtype, seed=13)
    w = upstream((2, 5), 13)
    expected = fused(logits, targets, mask, w, temperature=0.9, return_entropy=True)
    got = fused(logits, targets, mask, w, temperature=0.9, return_entropy=True, inplace_backward=True)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    x = logits.clone().requires_grad_()
    y = x * 2.0  # a non-leaf, like the output layer's logits
    out = fused_logprobs(y, targets, mask, inplace_backward=True, impl="ext")
    out.seq_logp.sum().backward()
    assert torch.equal(y.detach(), x.grad / 2), "the gradient was not written into the logits buffer"
    assert not torch.equal(y.detach(), logits * 2)


def test_invalid_targets_are_ignored_and_minus_inf_logits_are_fine():
    logits, targets, mask = make_case((2, 4, 300), torch.float32, seed=17)
    logits[:, :, 100:] = float("-inf")  # e.g. a masked vocab tail; targets stay in the finite part
    targets = targets % 100
    targets[0, 0], targets[1, 3] = -100, 300  # outside [0, V): ignored
    w = upstream((2, 4), 17)
    got = fused(logits, targets, mask, w, return_entropy=True)
    ref = oracle(logits, targets, mask, w, return_entropy=True)
    assert got[0][0, 0] == 0 and got[0][1, 3] == 0
    for name, a, r in zip(("token_logp", "seq_logp", "entropy", "grad"), got, ref):
        assert torch.isfinite(a).all() and rel_err(a, r) < 1e-5, name
    assert torch.all(got[3][:, :, 100:] == 0)


def test_batch_invariance_bitwise():
    """A row's log-prob, entropy and gradient do not depend on which rows share the batch."""
    rows, targets, _ = make_case((1, 40, 5003), torch.float32, seed=19)
    rows, targets = rows[0], targets[0]
    probe = 7

    def row_result(batch_ids):
        x = rows[batch_ids].clone().requires_grad_()  # [n, V], the probe somewhere inside
        out = fused_logprobs(x.unsqueeze(0), targets[batch_ids].unsqueeze(0), return_entropy=True, impl="ext")
        (out.token_logp.sum() + out.entropy.sum()).backward()
        i = batch_ids.index(probe)
        return out.token_logp[0, i].detach(), out.entropy[0, i].detach(), x.grad[i]

    base = row_result([probe])
    for ids in ([probe, 3], [0, 1, 2, probe], [*range(probe + 1), *range(20, 40)], [39, 38, probe, 12, 5]):
        for a, b in zip(row_result(list(ids)), base):
            assert torch.equal(a, b), ids


def test_impl_switch_and_fallback(monkeypatch, caplog):
    logits, targets, mask = make_case((2, 3, 50), torch.float32, seed=23)
    ref = reference_logprobs(logits, targets, mask)
    monkeypatch.setenv("PACS_LOGPROB_IMPL", "reference")
    assert torch.equal(fused_logprobs(logits, targets, mask).token_logp, ref.token_logp)
    monkeypatch.setenv("PACS_LOGPROB_IMPL", "bogus")
    with pytest.raises(ValueError, match="PACS_LOGPROB_IMPL"):
        fused_logprobs(logits, targets, mask)
    monkeypatch.delenv("PACS_LOGPROB_IMPL")
    # no extension: auto falls back to the reference with one warning, "ext" refuses
    monkeypatch.setattr(logprob_mod, "_C", None)
    monkeypatch.setattr(logprob_mod, "_C_ERROR", "simulated missing build")
    monkeypatch.setattr(logprob_mod, "ext_available", lambda device="cpu": False)
    monkeypatch.setattr(logging.getLogger("pacs_megatron"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="pacs_megatron"):
        out = fused_logprobs(logits, targets, mask)
    assert torch.equal(out.token_logp, ref.token_logp)
    assert "simulated missing build" in caplog.text
    with pytest.raises(RuntimeError, match="impl='ext'"):
        fused_logprobs(logits, targets, mask, impl="ext")


def test_input_validation_messages():
    from pacs_megatron import _C

    logits, targets, mask = make_case((2, 3, 10), torch.float32, seed=29)
    with pytest.raises(ValueError, match="targets shape"):
        fused_logprobs(logits, targets[:, :2], impl="ext")
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs(logits, targets, temperature=0.0, impl="ext")
    with pytest.raises(RuntimeError, match="targets must be int64"):
        _C.logprob_partial(logits, targets.int().reshape(-1), 0, 1.0, False)
    with pytest.raises(RuntimeError, match="stride 1 along the vocab dim"):
        _C.logprob_partial(logits.transpose(1, 2).contiguous().transpose(1, 2), targets.reshape(-1), 0, 1.0, False)
    with pytest.raises(RuntimeError, match="rowp must be"):
        _C.logprob_backward(logits, targets.reshape(-1), torch.zeros(5, 4), 0, 1.0, False, torch.empty_like(logits))
