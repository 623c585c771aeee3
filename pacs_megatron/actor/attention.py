"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` for the local (non-TE) layer spec.

megatron-core's local ``DotProductAttention`` materialises the ``[b, heads, s, s]`` scores with baddbmm,
masks them with a separately built causal mask, runs a softmax and a bmm, keeps the probabilities for
backward, and refuses packed (THD) sequences. On CPU this module replaces it: one fused SDPA call per
layer (causal, grouped-query heads; in bf16 on short rows two batched matmuls with an fp32 softmax, see
:data:`MATMUL_ATTENTION_MAX_LEN`), and THD-packed micro-batches (``PackedSeqParams``, actor/thd.py), so
the layers run on the rows' real tokens instead of rows padded to the longest one.

Shape legend: s sequence, b rows, t packed tokens, h query heads, g KV heads (this TP rank's), d head dim.

    sbhd: q [s, b, h, d], k/v [s, b, g, d]       -> [s, b, h * d]
    thd : q [t, h, d], k/v [t, g, d], cu_seqlens -> [t, h, d]    (megatron reshapes it to [t, 1, h * d])

Context parallelism (``parallel.cp`` > 1): each rank holds its zig-zag chunks of every row (sbhd) or of
every packed segment (THD; parallel/cp_split.py); K and V are all-gathered over the CP group and the causal
mask is built from the tokens' global positions: exact, and the CPU reference for TE's ring (actor/model.py).

THD attention scatters the packed tokens into a zero-padded ``[rows, max_len]`` layout, runs the causal
SDPA there and gathers the real tokens back: a padded query only attends to itself and earlier tokens of
its own (padding) row, so no real token ever sees padding or another row. Attention is a small share of
the FLOPs at these lengths; the linear layers, which are most of them, never see the padding.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from pacs_megatron.parallel.cp_comm import gather_for_attention
from pacs_megatron.parallel.cp_split import (
    causal_allowed,
    chunk_positions,
    gathered_positions,
    thd_chunk_index,
    thd_gathered_index,
)

MATMUL_ATTENTION_MAX_LEN = 256
"""Longest (padded) row for which half-precision attention on CPU runs as two batched matmuls with an fp32
softmax instead of SDPA: torch's CPU flash kernel is slow in bf16 on short rows. Measured fwd+bwd, one
thread, 9 heads of 64, bf16, flash / matmul ms (2026-11-25, loaded machine): T=48 103 / 22, T=80 91 / 29,
T=160 93 / 57, T=320 113 / 89, T=640 161 / 341; in fp32 flash is as fast or faster at every length."""


def _thd_index(cu_seqlens: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(rows [t], cols [t], num_rows, max_len)`` of every packed token from ``cu_seqlens [rows + 1]``."""
    bounds = cu_seqlens.to(torch.long).cpu()
    lens = bounds[1:] - bounds[:-1]
    rows = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    cols = torch.arange(int(bounds[-1])) - bounds[:-1][rows]
    return rows.to(device), cols.to(device), int(lens.numel()), int(lens.max())


class SDPACoreAttention(MegatronModule):
    """Drop-in for megatron's ``DotProductAttention`` (same constructor and forward signature), causal only."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,  # noqa: ARG002 - megatron's signature
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        from megatron.core.transformer.enums import AttnMaskType

        tp = pg_collection.tp.size() if pg_collection is not None else config.tensor_model_parallel_size
        cp_group = getattr(pg_collection, "cp", None)
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        """The CP group when the sequence is split over it (K/V are gathered over it), else None."""
        self.layer_number = layer_number
        self.heads = config.num_attention_heads // tp
        self.kv_heads = (config.num_query_groups or config.num_attention_heads) // tp
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout or attn_mask_type != AttnMaskType.causal or attention_type != "self":
            raise ValueError(
                "SDPACoreAttention supports causal self-attention without dropout only "
                f"(got mask {attn_mask_type}, type {attention_type!r}, dropout {dropout})"
            )

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None):
        """Attention on ``[b, h|g, s, d]``; KV heads are repeated for grouped-query attention. Causal, or
        ``bias`` (additive, 0 or -inf, ``[.., s_q, s_k]``) when the queries are a CP rank's chunks."""
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        s = k.shape[-2]
        if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and s <= MATMUL_ATTENTION_MAX_LEN:
            scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale
            if bias is None:
                scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            else:
                scores = scores + bias
            return torch.matmul(scores.softmax(dim=-1).to(q.dtype), v)
        if bias is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)

    def _cp_sbhd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """sbhd attention of this CP rank's chunks: K/V of every rank, the causal mask in global positions."""
        s, b = query.shape[:2]
        group = self.cp_group
        assert group is not None  # forward calls it only with a CP group
        cp, rank = group.size(), group.rank()
        kv = gather_for_attention(torch.stack([key, value]), group, dim=1)  # [2, s * cp, b, g, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, kv[0], kv[1]))
        bias = _sbhd_bias(s * cp, cp, rank, query.device, query.dtype)
        return self._sdpa(q, k, v, bias).permute(2, 0, 1, 3).reshape(s, b, -1)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,  # noqa: ARG002 - causal by construction
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention takes no explicit attention mask or bias (causal only)")
        if packed_seq_params is None and self.cp_group is not None:
            return self._cp_sbhd(query, key, value)
        if packed_seq_params is None:  # sbhd
            s, b = query.shape[:2]
            out = self._sdpa(*(x.permute(1, 2, 0, 3) for x in (query, key, value)))
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if self.cp_group is not None:
            return self._cp_thd(query, key, value, packed_seq_params.cu_seqlens_q)
        rows, cols, num_rows, width = _thd_index(packed_seq_params.cu_seqlens_q, query.device)

        def padded(x: torch.Tensor) -> torch.Tensor:  # [t, h, d] -> [rows, h, width, d]
            buf = x.new_zeros((num_rows, width, *x.shape[1:]))
            return buf.index_put((rows, cols), x).transpose(1, 2)

        out = self._sdpa(padded(query), padded(key), padded(value))
        return out.transpose(1, 2)[rows, cols]

    def _cp_thd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor):
        """THD attention of this CP rank's chunks of every segment: the gathered K/V laid out ``[segments,
        width]`` by global column, this rank's queries ``[segments, width / cp]``, masked by global column."""
        group = self.cp_group
        assert group is not None  # forward calls it only with a CP group
        cp, rank = group.size(), group.rank()
        bounds = tuple(cu_seqlens.to(torch.long).cpu().tolist())
        k_at, q_at, bias = _thd_layout(bounds, cp, rank, query.device, query.dtype)
        num_rows, width = bias.shape[0], bias.shape[-1]
        kv = gather_for_attention(torch.stack([key, value]), group, dim=1)  # [2, N, g, d]
        k = kv[0].new_zeros((num_rows, width, *key.shape[1:])).index_put(k_at, kv[0])
        v = kv[1].new_zeros((num_rows, width, *key.shape[1:])).index_put(k_at, kv[1])
        q = query.new_zeros((num_rows, width // cp, *query.shape[1:])).index_put(q_at, query)
        out = self._sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias)
        return out.transpose(1, 2)[q_at]


# One additive mask per shape, shared by every layer of a forward: SDPA keeps its mask for the backward, so a
# mask built per layer would cost a [s / cp, s] float per layer (measured: as much as CP saved, at 4k tokens).
@functools.lru_cache(maxsize=4)
def _sbhd_bias(length: int, cp: int, rank: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[length / cp, length]`` additive causal mask of this rank's chunks against the gathered keys."""
    allowed = causal_allowed(chunk_positions(length, cp, rank, device), gathered_positions(length, cp, device))
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


@functools.lru_cache(maxsize=4)
def _thd_layout(bounds: tuple[int, ...], cp: int, rank: int, device: torch.device, dtype: torch.dtype):
    """Where the gathered keys and this rank's queries sit in the ``[segments, width]`` layout, and the
    additive mask ``[segments, 1, width / cp, width]`` (global column of key <= of query)."""
    cu = torch.tensor(bounds)
    num_rows, width = cu.numel() - 1, int((cu[1:] - cu[:-1]).max())

    def row_col(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # packed position -> segment, column
        row = torch.searchsorted(cu[1:], index, right=True)
        return row, index - cu[row]

    k_rows, k_cols = row_col(thd_gathered_index(cu, cp))
    q_rows, q_cols = row_col(thd_chunk_index(cu, cp, rank))
    # a rank's tokens of one segment are contiguous: slot = place among them
    q_slot = torch.arange(q_rows.numel()) - (cu[:-1] // cp)[q_rows]
    # a slot without a query (a shorter segment) looks at column 0 only; its output is dropped
    q_pos = torch.zeros((num_rows, width // cp), dtype=torch.long).index_put((q_rows, q_slot), q_cols)
    allowed = torch.arange(width)[None, None, :] <= q_pos[:, :, None]
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))[:, None].to(device)
    return (k_rows.to(device), k_cols.to(device)), (q_rows.to(device), q_slot.to(device)), bias


def use_sdpa_attention(layer_spec):
    """``layer_spec`` (a local-spec ``ModuleSpec`` of a transformer layer, or a block spec holding
    ``layer_specs``) with every self-attention's core attention replaced by :class:`SDPACoreAttention`."""
    specs = getattr(layer_spec, "layer_specs", None) or [layer_spec]
    for spec in specs:
        attn = spec.submodules.self_attention
        attn.submodules.core_attention = SDPACoreAttention
    return layer_spec
