"""THD sequence packing for token-budget micro-batches on GPU with Transformer Engine.

**Unverified on GPU: written for megatron-core 0.16.1 + Transformer Engine, never run** (no GPU and no
TE where it was written; the index bookkeeping below is tested on CPU, the TE attention path is not).

A token-budget micro-batch (data/packing.py) still pads each row to the micro-batch's longest row.
With TE's THD format the rows are concatenated without padding into one sequence ``[1, total]``,
and attention and RoPE restart at every row boundary given by ``cu_seqlens`` (``PackedSeqParams``).
Shape legend: b rows, T the micro-batch's padded length, N packed tokens (+ tail padding), V/tp vocab shard.

    ids [b, T] --pack--> ids [1, N] --GPTModel(packed_seq_params)--> logits [1, N, V/tp]
                                                                      --unpack--> logits [b, T, V/tp]

Only the transformer layers run packed; the last stage scatters the logits back to the padded
``[b, T]`` layout (zeros at padding) so the log-prob op and every loss stay as they are, and the
old-log-prob pass and the training pass pack identically (batch invariance). N is padded up to a
multiple of ``8 * tp`` (sequence parallelism splits the packed sequence over TP) with one extra
pseudo-sequence, so no real row attends to the padding. The CPU path never calls this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ThdBatch:
    """One micro-batch packed for TE's THD attention.

    Example:
        >>> p = pack_thd(torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]), torch.tensor([3, 2]), multiple=4)
        >>> p.input_ids.tolist(), p.position_ids.tolist(), p.cu_seqlens.tolist()
        ([[5, 6, 7, 8, 9, 0, 0, 0]], [[0, 1, 2, 0, 1, 0, 1, 2]], [0, 3, 5, 8])
    """

    input_ids: torch.Tensor
    """``[1, N]`` rows concatenated, then tail padding."""
    position_ids: torch.Tensor
    """``[1, N]`` positions restarting at 0 in every row."""
    cu_seqlens: torch.Tensor
    """``[b + 2]`` int32 boundaries (the tail padding is the last pseudo-sequence)."""
    max_seqlen: int
    """Longest row (or the tail) in tokens."""
    rows: torch.Tensor
    """``[M]`` padded-layout row of each real packed token (M = sum of row lengths)."""
    cols: torch.Tensor
    """``[M]`` padded-layout column of each real packed token."""
    shape: tuple[int, int]
    """``(b, T)`` of the padded micro-batch."""

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, m = self.cu_seqlens.to(torch.int32), self.max_seqlen
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m)

    def unpack(self, logits: torch.Tensor) -> torch.Tensor:
        """``[1, N, V]`` packed logits -> ``[b, T, V]`` padded layout, zeros at padding (differentiable)."""
        b, T = self.shape
        out = logits.new_zeros((b, T, logits.shape[-1]))
        return out.index_put((self.rows.to(logits.device), self.cols.to(logits.device)), logits[0, : self.rows.numel()])


def pack_thd(input_ids: torch.Tensor, seq_lens: torch.Tensor, multiple: int = 8) -> ThdBatch:
    """Pack right-padded rows ``[b, T]`` of lengths ``seq_lens [b]`` into one THD sequence."""
    b, T = input_ids.shape
    lens = seq_lens.to(torch.long).cpu()
    mask = torch.arange(T)[None] < lens[:, None]  # [b, T] real tokens
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: row 0's tokens, then row 1's ...
    real = int(lens.sum())
    total = -(-real // multiple) * multiple
    tail = total - real
    ids = torch.zeros((1, total), dtype=input_ids.dtype)
    ids[0, :real] = input_ids.cpu()[rows, cols]
    pos = torch.cat([cols, torch.arange(tail)])[None]
    bounds = [0, *torch.cumsum(lens, 0).tolist()] + ([total] if tail else [])
    return ThdBatch(
        input_ids=ids.to(input_ids.device),
        position_ids=pos.to(input_ids.device),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=input_ids.device),
        max_seqlen=int(max(int(lens.max()), tail)),
        rows=rows,
        cols=cols,
        shape=(b, T),
    )


def use_thd(dynamic_batching: bool, device: torch.device) -> bool:
    """THD packing: with dynamic batching, on GPU, where Transformer Engine imports (the layer spec
    is then TE's, whose attention reads ``packed_seq_params``)."""
    from pacs_megatron.actor.model import have_transformer_engine

    return dynamic_batching and device.type == "cuda" and have_transformer_engine()
