"""Shared cases of the fused LM head tests (test_head_cpu.py, test_head_cuda.py): a random (hidden, weight,
targets, mask) case, the three ways to compute it (the fused op, the unfused path the actor runs without the
switch, the fp64 oracle) and the relative error.

The unfused path is ``logits = hidden @ W.T`` (padded vocab columns masked as actor/model.py does) then
``fused_logprobs``; the oracle is ``reference_logprobs`` on the fp64 product. Every result comes back as
fp64 on the CPU: (token_logp, seq_logp, entropy, grad_hidden, grad_weight).
"""

from __future__ import annotations

import torch

from pacs_megatron.ops import fused_head_logprobs, fused_logprobs, reference_logprobs

B, T, H, V = 3, 7, 24, 203  # V odd: blocks of 64 columns leave a ragged last block
NAMES = ("token_logp", "seq_logp", "entropy", "grad_hidden", "grad_weight")


def make_head_case(dtype, seed=0, vocab=V, device="cpu", shape=(B, T, H)):
    """(hidden [B, T, H], weight [vocab, H], targets, mask, upstream weights) on ``device``."""
    b, t, h = shape
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, h, generator=gen, dtype=torch.float64) * 0.4).to(dtype)
    targets = torch.randint(0, vocab, (b, t), generator=gen)
    targets[0, -1] = -100  # an ignored position: logp 0, no gradient
    mask = torch.rand(b, t, generator=gen) > 0.3
    ups = (torch.randn(b, t, generator=gen), torch.randn(b, generator=gen), torch.randn(b, t, generator=gen))
    return tuple(x.to(device) for x in (hidden, weight, targets, mask)) + (tuple(u.to(device) for u in ups),)


def _loss(out, ups):
    w_tok, w_seq, w_ent = ups
    loss = (out.token_logp * w_tok.to(out.token_logp.dtype)).sum() + (out.seq_logp * w_seq.to(out.seq_logp.dtype)).sum()
    if out.entropy is not None:
        loss = loss + (out.entropy * w_ent.to(out.entropy.dtype)).sum()
    return loss


def _pad_mask(logits, vocab_size):
    if vocab_size is None or vocab_size == logits.size(-1):
        return logits
    pad = torch.arange(logits.size(-1), device=logits.device) >= vocab_size
    return logits.masked_fill(pad, -1e30)


def run_head(kind, hidden, weight, targets, mask, ups, *, temperature, entropy, vocab_size=None, block=64, impl="ext"):
    """(token_logp, seq_logp, entropy, grad_hidden, grad_weight) as fp64 on the CPU, for ``kind`` = "fused"
    (the op under test), "unfused" (the actor's path without the switch) or "oracle" (fp64 reference)."""
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
    ent = out.entropy.detach() if entropy else torch.zeros(1)
    return [x.double().cpu() for x in (out.token_logp.detach(), out.seq_logp.detach(), ent, h.grad, w.grad)]


def run_oracle(hidden, weight, *rest, **kw):
    """The fp64 oracle of a case: its hidden states and weight promoted to fp64 first."""
    return run_head("oracle", hidden.double(), weight.double(), *rest, **kw)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
