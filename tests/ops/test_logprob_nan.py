"""NaN semantics of the fused log-prob op: a NaN logit makes that row's log-prob, lse and entropy NaN (and the
sequence sum of its sequence), and nothing else changes; rows without upstream gradient get exact zero grads.

Before the fix the CPU op returned +inf for a NaN row (the combine step dropped the NaN shard as "no mass").
CPU cases run here; the same checks on CUDA are marked gpu (passed on an H100, 2026-11-25). The shard
merge (tensor parallel) is checked without processes by combining two shards' partial stats directly.
"""

from __future__ import annotations

import pytest
import torch
from _logprob_helpers import fused, make_case, needs_ext, oracle, rel_err, upstream

from pacs_megatron.ops import ext_available

NAN = float("nan")
SHAPE = (2, 4, 4500)  # V > 2 CPU blocks (2048): an all-NaN first block takes the rare path


def _devices():
    cuda = pytest.param("cuda", marks=[pytest.mark.gpu])
    return ["cpu", cuda]


def _case(dtype, device):
    logits, targets, mask = make_case(SHAPE, dtype, seed=41, device=device, mask_p=0.0)
    logits[0, 1, 777] = NAN  # one NaN in the middle of a row
    logits[1, 2, :2100] = NAN  # a whole first block NaN: the running max is still -inf there
    return logits, targets, mask


@needs_ext
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_row_gives_nan_for_that_row_only(device, dtype):
    if device == "cuda" and not ext_available("cuda"):
        pytest.skip("the extension was built without CUDA")
    logits, targets, mask = _case(dtype, device)
    w = upstream(SHAPE, 41, device=device)
    got = [None if r is None else r.cpu() for r in fused(logits, targets, mask, w, return_entropy=True)]
    ref = [None if r is None else r.cpu() for r in oracle(logits, targets, mask, w, return_entropy=True)]
    tok, seq, ent, grad = got
    nan_rows = torch.zeros(SHAPE[:2], dtype=torch.bool)
    nan_rows[0, 1] = nan_rows[1, 2] = True
    assert torch.equal(torch.isnan(tok), nan_rows) and torch.equal(torch.isnan(ent), nan_rows)
    assert torch.isnan(seq).all()  # both sequences hold a NaN row inside the mask
    assert torch.isnan(grad[nan_rows]).any(dim=-1).all()
    ok = ~nan_rows
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(tok[ok], ref[0][ok]) < tol and rel_err(ent[ok], ref[2][ok]) < tol
    assert torch.isfinite(grad[ok]).all() and rel_err(grad[ok], ref[3][ok]) < tol


@needs_ext
@pytest.mark.parametrize("device", _devices())
def test_rows_without_upstream_grad_get_zero_grad_even_if_nan(device):
    if device == "cuda" and not ext_available("cuda"):
        pytest.skip("the extension was built without CUDA")
    logits, targets, mask = _case(torch.float32, device)
    targets[0, 1] = -100  # the NaN row's target is ignored: logp is the constant 0, no gradient
    x = logits.clone().requires_grad_()
    from pacs_megatron.ops import fused_logprobs

    out = fused_logprobs(x, targets, mask, impl="ext")
    assert out.token_logp[0, 1].item() == 0.0
    out.token_logp[0].sum().backward()  # sequence 1 (another NaN row) gets no upstream gradient at all
    g = x.grad.cpu()
    assert torch.all(g[0, 1] == 0) and torch.all(g[1] == 0)
    assert torch.isfinite(g[0]).all()


@needs_ext
def test_shard_merge_keeps_nan():
    """Vocab-parallel combine: a NaN in one shard's row makes the combined row NaN (other rows exact)."""
    from pacs_megatron.ops.logprob import _ext

    C = _ext()
    logits, targets, _ = make_case((1, 3, 4000), torch.float32, seed=43)
    logits[0, 1, 3500] = NAN  # in shard 1 only
    rows, flat = logits[0], targets.reshape(-1)
    shards = [rows[:, :2000].unsqueeze(0).contiguous(), rows[:, 2000:].unsqueeze(0).contiguous()]
    stats = torch.stack([C.logprob_partial(s, flat, r * 2000, 1.0, True) for r, s in enumerate(shards)])
    res = C.logprob_combine(stats, flat, 4000)
    ref = torch.log_softmax(rows.double(), -1).gather(-1, flat[:, None])[:, 0]
    assert torch.isnan(res[1]).all()
    assert torch.allclose(res[[0, 2], 0].double(), ref[[0, 2]], rtol=1e-5)
