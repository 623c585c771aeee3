"""Fused LM head + log-prob (issue 44): hidden states and the vocab-parallel output weight in, per-token
log-probs and entropy out, without ever materialising the ``[N, V]`` logits or their gradient.

    hidden [N, H] --(Vc vocab columns at a time: z = h @ W[k]^T, [N, Vc])--> per-block row stats [K, N, 4]
        --one all-gather over tp_group--> [W * K, N, 4] --combine (running max / sum-exp)--> (logp, lse, H) [N]
    backward: per block, recompute z, write d/dz into the block, grad_weight[k] = g^T @ h,
        grad_hidden += g @ W[k]; then ONE all-reduce of grad_hidden over tp_group

The all-reduce is the one megatron's output layer does (``reduce_grad_input=True``); under sequence
parallelism the caller gathers the sequence itself and passes False. Kernels: ``pacs_megatron._C`` (csrc/head.cpp)
or ``ops/head_reference.py``, by ``impl=`` / ``PACS_LOGPROB_IMPL``. Why blocks of columns, precision, memory,
cost and the GPU timings: docs/kernel.md, "The fused LM head".

Legend: N = B * T rows; H hidden; V = V_local vocab shard; W tp world; Vc block columns; K = ceil(V / Vc) blocks.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pacs_megatron.ops import head_reference
from pacs_megatron.ops.logprob import _all_gather_stats, _ext, _resolve_impl
from pacs_megatron.ops.reference import tp_world_and_rank
from pacs_megatron.ops.types import LogprobOutput
from pacs_megatron.utils.logging import get_logger, warn_once

logger = get_logger(__name__)

BLOCK_BYTES_ENV = "PACS_HEAD_BLOCK_BYTES"
DEFAULT_BLOCK_BYTES = 32 << 20
"""Budget of the logits block (in the hidden states' dtype) when ``block_cols`` is not given."""

_REFERENCE = SimpleNamespace(
    head_partial=head_reference.head_partial,
    logprob_combine=head_reference.logprob_combine,
    head_backward=head_reference.head_backward,
)


def default_block_cols(rows: int, vocab_local: int, dtype: torch.dtype) -> int:
    """Vocab columns per logits block: ``PACS_HEAD_BLOCK_BYTES`` (default 32 MiB) over one column's bytes
    (``rows`` values), a multiple of 256 (GEMM tiles, vector width), at least 256, at most ``vocab_local``."""
    budget = int(os.environ.get(BLOCK_BYTES_ENV, DEFAULT_BLOCK_BYTES))
    per_col = max(1, rows) * torch.empty((), dtype=dtype).element_size()
    return max(1, min(vocab_local, max(256, budget // per_col // 256 * 256)))


def _backend(device: torch.device, impl: str | None):
    if _resolve_impl(device, impl) == "ext":
        mod = _ext()
        if hasattr(mod, "head_partial"):
            return mod
        if (impl or os.environ.get("PACS_LOGPROB_IMPL", "auto")).lower() == "ext":
            raise RuntimeError("pacs_megatron._C has no head ops (stale build): rebuild the extension")
        warn_once(logger, "pacs_megatron._C has no fused-head ops (stale build); using the pure-torch twin")
    return _REFERENCE


class _FusedHeadFn(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (token_logp [N], entropy [N]); module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, tp_group, with_entropy, vocab_size, block, impl, reduce):
        world, rank = tp_world_and_rank(tp_group)
        vocab = weight.size(0)
        valid_local = max(0, min(vocab, vocab_size - rank * vocab))
        inv_temp = 1.0 / temperature
        stats = impl.head_partial(hidden, weight, targets, rank * vocab, inv_temp, with_entropy, valid_local, block)
        k, n = stats.shape[0], stats.shape[1]  # [K, N, 4]: the blocks merge like TP shards
        gathered = _all_gather_stats(stats.reshape(k * n, 4), tp_group, world)  # [W, K * N, 4], one collective
        res = impl.logprob_combine(gathered.reshape(world * k, n, 4), targets, world * vocab)
        logp, lse, entropy = res.t().contiguous().unbind(dim=0)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.meta = (inv_temp, rank, world, with_entropy, valid_local, block, impl, tp_group, reduce)
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        inv_temp, rank, world, with_entropy, valid_local, block, impl, tp_group, reduce = ctx.meta
        nones = (None,) * 8
        use_entropy = with_entropy and g_entropy is not None
        if g_logp is None and not use_entropy:
            return None, None, *nones
        rowp = torch.zeros((lse.numel(), 4), dtype=lse.dtype, device=lse.device)
        rowp[:, 0] = lse
        if g_logp is not None:
            valid = (targets >= 0) & (targets < world * weight.size(0))  # invalid targets: logp is the constant 0
            rowp[:, 1] = torch.where(valid, g_logp, torch.zeros_like(g_logp))
        if use_entropy:
            rowp[:, 2] = g_entropy
            rowp[:, 3] = entropy
        grad_hidden = torch.empty_like(hidden)
        grad_weight = impl.head_backward(
            hidden, weight, targets, rowp, rank * weight.size(0), inv_temp, use_entropy, valid_local, block, grad_hidden
        )
        if reduce and world > 1:
            dist.all_reduce(grad_hidden, group=tp_group)  # what ColumnParallelLinear's backward does (docstring)
        return (
            grad_hidden if ctx.needs_input_grad[0] else None,
            grad_weight if ctx.needs_input_grad[1] else None,
            *nones,
        )


def _check_args(hidden, weight, targets, mask, temperature) -> None:
    if hidden.dim() not in (2, 3) or tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"hidden must be [B, T, H] or [N, H] and targets its leading shape; got hidden {tuple(hidden.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    if weight.dim() != 2 or weight.size(1) != hidden.size(-1):
        raise ValueError(f"weight must be [V_local, H={hidden.size(-1)}], got {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one float dtype")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must hold integer token ids (int64), got {targets.dtype}")
    if mask is not None and tuple(mask.shape) != tuple(targets.shape):
        raise ValueError(f"mask must be shaped like targets {tuple(targets.shape)}, got {tuple(mask.shape)}")
    if not (temperature > 0 and temperature < float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")


def fused_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    tp_group=None,
    return_entropy: bool = False,
    vocab_size: int | None = None,
    block_cols: int | None = None,
    reduce_grad_input: bool = True,
    impl: str | None = None,
) -> LogprobOutput:
    """Log-probs of ``targets`` under softmax(hidden @ weight^T / temperature), vocab sharded on ``tp_group``.

    Args:
        hidden: [B, T, H] (or [N, H]) final-norm hidden states, the same on every TP rank; fp32/bf16/fp16
            (fp64 for gradcheck).
        weight: [V_local, H] this rank's rows of the output weight (ids [r V_local, (r + 1) V_local)), same dtype.
        targets: [B, T] (or [N]) global token ids; ids outside [0, W * V_local) give logp 0 and no gradient.
        mask: optional [B, T] positions summed into ``seq_logp`` (others add exactly 0).
        temperature: divides the logits before the softmax.
        tp_group: the vocab's process group (None: unsharded); one all-gather of [N, 4] in forward.
        return_entropy: also return the per-token entropy (differentiable).
        vocab_size: real vocab ids (global); the padded ids [vocab_size, W * V_local) are masked out.
        block_cols: vocab columns per logits block (default :func:`default_block_cols`).
        reduce_grad_input: all-reduce grad_hidden over ``tp_group`` (False under sequence parallelism: the
            caller's gather reduce-scatters it).
        impl: "ext" | "reference" | "auto" (default: env PACS_LOGPROB_IMPL, else auto).
    Returns:
        LogprobOutput shaped like ``targets`` (float32; float64 for float64 inputs), as ``fused_logprobs``.
    """
    _check_args(hidden, weight, targets, mask, temperature)
    world, _ = tp_world_and_rank(tp_group)
    vocab_global = world * weight.size(0)
    if vocab_size is not None and not 0 < vocab_size <= vocab_global:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, W * V_local = {vocab_global}]")
    hidden2 = hidden.reshape(-1, hidden.size(-1))
    block = block_cols or default_block_cols(hidden2.size(0), weight.size(0), hidden.dtype)
    flat_targets = targets.reshape(-1).to(torch.int64).contiguous()
    logp, entropy = _FusedHeadFn.apply(
        hidden2,
        weight,
        flat_targets,
        float(temperature),
        tp_group,
        return_entropy,
        vocab_size or vocab_global,
        int(block),
        _backend(hidden.device, impl),
        reduce_grad_input,
    )
    token_logp = logp.view(targets.shape)
    seq_logp = None
    if mask is not None:
        seq_logp = torch.where(mask.bool(), token_logp, torch.zeros_like(token_logp)).sum(dim=-1)
    return LogprobOutput(
        token_logp=token_logp, seq_logp=seq_logp, entropy=entropy.view(targets.shape) if return_entropy else None
    )
