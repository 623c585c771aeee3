"""Fused vocab-parallel log-prob op: autograd wrapper around ``pacs_megatron._C`` and the public function.

Forward (per row n of the local shard, z = logits / temperature):
    1. ``_C.logprob_partial``  -> [N, 4] (max, sum exp(z - max), z_target or 0, sum e (z - max)), one read of the logits
    2. one all-gather of those stats over ``tp_group`` -> [W, N, 4]   (the only collective; Megatron's path uses 3)
    3. ``_C.logprob_combine``  -> [N, 3] (logp, lse, entropy) by max rescaling, in C++/CUDA per row, so a row's
       result does not depend on the rest of the batch (bit-identical batch invariance on CPU)
Backward: ``_C.logprob_backward`` recomputes p = softmax(z) from the logits and the saved per-row lse (nothing
N x V is saved; no collective: every rank already holds the global lse and entropy):
    d/dx_v = (g_logp * (onehot_v - p_v) - g_H * p_v * (log p_v + H)) / temperature
written in the logits' dtype, into the logits buffer itself with ``inplace_backward=True``.

Implementation choice: the extension when it is built for the logits' device, else the pure-torch reference
(``ops/reference.py``) with a one-time warning. ``impl="ext"|"reference"`` or env ``PACS_LOGPROB_IMPL``
overrides (``auto`` by default); ``ext`` raises if the extension is missing. Design, layers and the GPU runs:
docs/kernel.md.

Legend: B, T leading dims; N = B * T rows; V = V_local (this rank's vocab shard); W = tp world size.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from pacs_megatron.ops.reference import reference_logprobs, tp_world_and_rank
from pacs_megatron.ops.types import LogprobOutput
from pacs_megatron.utils.logging import get_logger, warn_once

logger = get_logger(__name__)

IMPL_ENV = "PACS_LOGPROB_IMPL"
_IMPLS = ("auto", "ext", "reference")
_C: Any = None
"""The compiled extension module once :func:`_ext` loaded it (every op below runs after that check)."""
_C_ERROR: str | None = None


def _ext():
    """The compiled extension module, or None (the import error is kept for messages)."""
    global _C, _C_ERROR
    if _C is None and _C_ERROR is None:
        try:
            from pacs_megatron import _C as mod  # type: ignore[attr-defined]  # torch first: _C needs libc10

            if not hasattr(mod, "logprob_partial"):
                raise ImportError("pacs_megatron._C has no logprob ops (stale build): rebuild the extension")
            _C = mod
        except ImportError as e:
            _C_ERROR = str(e)
    return _C


def ext_available(device: torch.device | str = "cpu") -> bool:
    """Whether the compiled op exists for ``device`` (CPU always when built; CUDA when built with CUDA)."""
    mod = _ext()
    dev = torch.device(device)
    if mod is None:
        return False
    return dev.type == "cpu" or (dev.type == "cuda" and mod.built_with_cuda())


def _resolve_impl(device: torch.device, impl: str | None) -> str:
    choice = (impl or os.environ.get(IMPL_ENV) or "auto").lower()
    if choice not in _IMPLS:
        raise ValueError(f"impl / {IMPL_ENV}={choice!r}: use one of {_IMPLS}")
    if choice == "reference":
        return choice
    if ext_available(device):
        return "ext"
    why = _C_ERROR or f"the extension was built without {device.type.upper()} support"
    if choice == "ext":
        raise RuntimeError(f"fused log-prob op requested (impl='ext') but unavailable on {device}: {why}")
    warn_once(logger, f"fused log-prob op unavailable on {device.type} ({why}); using the pure-torch reference")
    return "reference"


def _all_gather_stats(stats: torch.Tensor, tp_group, world: int) -> torch.Tensor:
    """[N, 4] local stats -> [W, N, 4] in rank order, with exactly one collective."""
    if world == 1:
        return stats.unsqueeze(0)
    out = torch.empty((world * stats.size(0), stats.size(1)), dtype=stats.dtype, device=stats.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 renamed it
    gather(out, stats, group=tp_group)
    return out.view(world, stats.size(0), stats.size(1))


class _FusedLogprobFn(torch.autograd.Function):
    """(logits [B, T, V], targets [N]) -> (token_logp [N], entropy [N]); see the module docstring."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, tp_group, with_entropy, inplace_backward):
        world, rank = tp_world_and_rank(tp_group)
        vocab = logits.size(-1)
        inv_temp = 1.0 / temperature
        stats = _C.logprob_partial(logits, targets, rank * vocab, inv_temp, with_entropy)
        res = _C.logprob_combine(_all_gather_stats(stats, tp_group, world), targets, world * vocab)
        logp, lse, entropy = res.t().contiguous().unbind(dim=0)  # contiguous [N] each
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.meta = (inv_temp, rank * vocab, world * vocab, with_entropy, inplace_backward)
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        inv_temp, vocab_start, vocab_global, with_entropy, inplace = ctx.meta
        if g_logp is None and (g_entropy is None or not with_entropy):
            return None, None, None, None, None, None
        rowp = torch.zeros((lse.numel(), 4), dtype=lse.dtype, device=lse.device)
        rowp[:, 0] = lse
        if g_logp is not None:
            valid = (targets >= 0) & (targets < vocab_global)  # invalid targets: logp is the constant 0
            rowp[:, 1] = torch.where(valid, g_logp, torch.zeros_like(g_logp))
        use_entropy = with_entropy and g_entropy is not None
        if use_entropy:
            rowp[:, 2] = g_entropy
            rowp[:, 3] = entropy
        grad = logits if inplace else torch.empty_like(logits)
        _C.logprob_backward(logits, targets, rowp, vocab_start, inv_temp, use_entropy, grad)
        if inplace:
            torch.autograd.graph.increment_version(logits)  # later users of the overwritten logits fail loudly
        return grad, None, None, None, None, None


def _check_args(logits, targets, mask, temperature) -> None:
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be [B, T, V] or [N, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor (fp32/bf16/fp16/fp64), got {logits.dtype}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        want = tuple(logits.shape)[:-1]
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal logits.shape[:-1] {want}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must hold integer token ids (int64), got {targets.dtype}")
    if targets.device != logits.device:
        raise ValueError(f"targets is on {targets.device} but logits on {logits.device}")
    if mask is not None and (tuple(mask.shape) != tuple(targets.shape) or mask.device != logits.device):
        raise ValueError(
            f"mask must be shaped like targets {tuple(targets.shape)} on {logits.device}, "
            f"got {tuple(mask.shape)} on {mask.device}"
        )
    if not (temperature > 0 and temperature < float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")


def fused_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    tp_group=None,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    impl: str | None = None,
) -> LogprobOutput:
    """Log-probs of ``targets`` under softmax(logits / temperature) over a vocab sharded on ``tp_group``.

    Args:
        logits: [B, T, V_local] (or [N, V_local]) fp32/bf16/fp16 (fp64: CPU/reference, for gradcheck): rank r of
            ``tp_group`` holds global ids [r * V_local, (r + 1) * V_local) (Megatron vocab-parallel layout).
            Any strides on the leading dims (e.g. ``logits[:, :-1]`` or a transposed [T, B, V] buffer) are read in
            place; only a vocab stride != 1 forces a contiguous copy.
        targets: [B, T] (or [N]) global token ids, int64 (int32 is converted). Ids outside [0, V_global) give
            token_logp 0 and no gradient (an ignore index); ids outside the local shard add nothing locally.
        mask: optional bool (or 0/1) [B, T]: positions summed into ``seq_logp``; others add exactly 0 (value and grad).
        temperature: divides the logits before the softmax.
        tp_group: process group the vocab is sharded over; None = unsharded. One all-gather of [N, 4] stats in
            forward, no collective in backward.
        return_entropy: also return the per-token entropy (differentiable).
        inplace_backward: write the logits gradient into the logits buffer (ext path only). The caller must not
            use ``logits`` after backward; autograd's version counter flags later readers. Saves an N x V buffer.
            For a sliced view (``logits[:, :-1]``) autograd still materialises the base tensor's gradient; to keep
            the saving, pass the full logits with the last target set to an invalid id such as -100.
        impl: "ext" | "reference" | "auto" (default: env PACS_LOGPROB_IMPL, else auto).
    Returns:
        LogprobOutput(token_logp [B, T], seq_logp [B] if mask is given, entropy [B, T] if asked), float32
        (float64 for float64 logits).
    """
    _check_args(logits, targets, mask, temperature)
    if _resolve_impl(logits.device, impl) == "reference":
        return reference_logprobs(
            logits,
            targets,
            mask,
            temperature=temperature,
            tp_group=tp_group,
            return_entropy=return_entropy,
            compute_dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32,
        )
    logits3 = logits.unsqueeze(0) if logits.dim() == 2 else logits
    if logits3.stride(-1) != 1 and logits3.size(-1) != 1:
        logits3 = logits3.contiguous()  # documented: the op streams rows with unit vocab stride
    flat_targets = targets.reshape(-1).to(torch.int64).contiguous()
    logp, entropy = _FusedLogprobFn.apply(
        logits3, flat_targets, float(temperature), tp_group, return_entropy, inplace_backward
    )
    token_logp = logp.view(targets.shape)
    seq_logp = None
    if mask is not None:
        seq_logp = torch.where(mask.bool(), token_logp, torch.zeros_like(token_logp)).sum(dim=-1)
    return LogprobOutput(
        token_logp=token_logp, seq_logp=seq_logp, entropy=entropy.view(targets.shape) if return_entropy else None
    )
