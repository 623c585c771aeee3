"""Shared helpers of the log-prob op tests: random cases, the fp64 oracle, error measures.

Every expected value comes from ``reference_logprobs`` in float64 on the same (possibly bf16-rounded)
logits, an independent plain-torch formulation; the "torch's own error" yardstick for low precision is
``log_softmax(logits / T).gather`` computed in the logits' dtype (the flash-attention rule: the fused op
may be at most 2x worse than torch at the same precision).
"""

from __future__ import annotations

import os

import pytest
import torch

from pacs_megatron.ops import ext_available, fused_logprobs, reference_logprobs

needs_ext = pytest.mark.skipif(
    os.environ.get("PACS_SKIP_EXT") == "1" and not ext_available("cpu"),
    reason="extension deliberately not built (PACS_SKIP_EXT=1)",
)


def make_case(shape, dtype, *, seed, scale=2.0, device="cpu", mask_p=0.3):
    """Fresh random (logits [B, T, V], targets [B, T], mask [B, T]) for ``shape`` = (B, T, V)."""
    gen = torch.Generator().manual_seed(seed)
    b, t, v = shape
    logits = (torch.randn(b, t, v, generator=gen, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, v, (b, t), generator=gen)
    mask = torch.rand(b, t, generator=gen) > mask_p
    return logits.to(device), targets.to(device), mask.to(device)


def upstream(shape, seed, device="cpu"):
    """Random upstream weights for token_logp, seq_logp and entropy (grads of all three are honoured)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    b, t = shape[0], shape[1]
    return (
        torch.randn(b, t, generator=gen, dtype=torch.float64).to(device),
        torch.randn(b, generator=gen, dtype=torch.float64).to(device),
        torch.randn(b, t, generator=gen, dtype=torch.float64).to(device),
    )


def loss_of(out, w_tok, w_seq, w_ent):
    loss = (out.token_logp * w_tok.to(out.token_logp.dtype)).sum()
    if out.seq_logp is not None:
        loss = loss + (out.seq_logp * w_seq.to(out.seq_logp.dtype)).sum()
    if out.entropy is not None:
        loss = loss + (out.entropy * w_ent.to(out.entropy.dtype)).sum()
    return loss


def run(fn, logits, targets, mask, weights, **kw):
    """Forward + backward of ``fn``; returns (token_logp, seq_logp, entropy or None, grad) as float64 detached."""
    x = logits.detach().clone().requires_grad_()
    out = fn(x, targets, mask, **kw)
    loss_of(out, *weights).backward()
    ent = None if out.entropy is None else out.entropy.detach().double()
    return out.token_logp.detach().double(), out.seq_logp.detach().double(), ent, x.grad.double()


def oracle(logits, targets, mask, weights, *, temperature=1.0, return_entropy=False):
    """fp64 reference on the same logits (upcast exactly)."""
    ref = lambda x, t, m, **kw: reference_logprobs(x, t, m, compute_dtype=torch.float64, **kw)  # noqa: E731
    return run(ref, logits.double(), targets, mask, weights, temperature=temperature, return_entropy=return_entropy)


def fused(logits, targets, mask, weights, **kw):
    return run(fused_logprobs, logits, targets, mask, weights, impl="ext", **kw)


def torch_naive(logits, targets, mask, weights, *, temperature=1.0):
    """Torch's own path in the logits' dtype: log_softmax(x / T).gather, backward through autograd."""
    x = logits.detach().clone().requires_grad_()
    logp = torch.log_softmax(x / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    seq = torch.where(mask, logp, torch.zeros_like(logp)).sum(-1)
    w_tok, w_seq, _ = weights
    ((logp * w_tok.to(logp.dtype)).sum() + (seq * w_seq.to(seq.dtype)).sum()).backward()
    return logp.detach().double(), seq.detach().double(), None, x.grad.double()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (norm-wise relative error, robust to entries near 0)."""
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a - ref).abs().max().item()
