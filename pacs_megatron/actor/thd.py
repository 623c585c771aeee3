"""THD sequence packing for token-budget micro-batches: the layers run on the rows' real tokens only.

A token-budget micro-batch (batch/packing.py) still pads each row to the micro-batch's longest row (with
short and truncated responses in one group, about half the tokens of a SmolLM2 step were padding).
In the THD format the rows are concatenated without padding into one sequence ``[1, N]``, and attention
and RoPE restart at every row boundary given by ``cu_seqlens`` (``PackedSeqParams``). On CPU the core
attention is actor/attention.py's SDPA module (megatron's local one refuses THD); on GPU it is
Transformer Engine's (**that path is written for GPU, never run**).
Shape legend: b rows, T the micro-batch's padded length, N packed tokens (+ tail padding), V/tp vocab shard.

    ids [b, T] --pack--> ids [1, N] --GPTModel(packed_seq_params)--> logits [1, N, V/tp]
        --log-prob op (targets: next_token_targets)--> [1, N] --unpack_predictions--> token_logp [b, T]

The log-prob op runs on the packed logits (no padded N x V copy); only the per-token results go back
to the padded ``[b, T]`` layout every loss reads. The old-log-prob pass and the training pass pack
identically (batch invariance). N is padded up to a multiple of ``8 * tp`` (sequence parallelism
splits the packed sequence over TP) with one extra pseudo-sequence, so no real row attends to the padding.
Under context parallelism each row's segment is padded to a multiple of 2 * cp and split over the CP
ranks segment by segment (parallel/cp_split.py ``thd_chunk_index``), as Transformer Engine requires.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pacs_megatron.parallel.cp_split import thd_chunk_index, thd_gathered_index


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
    cp: int = 1
    """Context-parallel size the segments are padded for (each a multiple of 2 * cp tokens)."""

    @property
    def index(self) -> torch.Tensor:
        """``[M]`` packed position of each real token (contiguous rows when cp = 1)."""
        return self.cu_seqlens[self.rows.to(self.cu_seqlens.device)].long() + self.cols.to(self.cu_seqlens.device)

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, m = self.cu_seqlens.to(torch.int32), self.max_seqlen
        # under CP the segments are already padded for TE: the padded boundaries are the boundaries
        padded = {"cu_seqlens_q_padded": cu, "cu_seqlens_kv_padded": cu} if self.cp > 1 else {}
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m, **padded
        )

    def cp_local_index(self, rank: int) -> torch.Tensor:
        """``[N // cp]`` the packed positions CP rank ``rank`` runs (all of them when cp = 1)."""
        if self.cp == 1:
            return torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        return thd_chunk_index(self.cu_seqlens, self.cp, rank).to(self.input_ids.device)

    def cp_unsplit(self, gathered: torch.Tensor) -> torch.Tensor:
        """``[1, N]`` in packed order from the CP ranks' ``[1, N // cp]`` values concatenated in rank order."""
        order = torch.argsort(thd_gathered_index(self.cu_seqlens, self.cp)).to(gathered.device)
        return gathered.index_select(1, order)

    def next_token_targets(self, ignore_id: int) -> torch.Tensor:
        """``[1, N]`` the token each packed position predicts (the next one of its row); ``ignore_id`` at a
        row's last token and on the padding (no prediction, log-prob 0, no gradient)."""
        targets = torch.full_like(self.input_ids, ignore_id)
        dev = self.input_ids.device
        index, rows, cols = self.index.to(dev), self.rows.to(dev), self.cols.to(dev)
        has_next = cols + 1 < torch.bincount(rows, minlength=self.shape[0])[rows]
        targets[0, index[has_next]] = self.input_ids[0, index[has_next] + 1]
        return targets

    def unpack_predictions(self, values: torch.Tensor) -> torch.Tensor:
        """``[1, N]`` per-position values of the packed next-token predictions -> ``[b, T]`` in the padded
        convention (column t holds the prediction of token t, column 0 and padding hold 0); differentiable."""
        b, T = self.shape
        dev = values.device
        index, rows, cols = self.index.to(dev), self.rows.to(dev), self.cols.to(dev) + 1
        keep = cols < torch.bincount(rows, minlength=b)[rows]  # a row's last token predicts nothing
        out = values.new_zeros((b, T))
        return out.index_put((rows[keep], cols[keep]), values[0, index[keep]])


def pack_thd(input_ids: torch.Tensor, seq_lens: torch.Tensor, multiple: int = 8, cp: int = 1) -> ThdBatch:
    """Pack right-padded rows ``[b, T]`` of lengths ``seq_lens [b]`` into one THD sequence; with ``cp`` > 1
    each row's segment is padded to a multiple of ``2 * cp`` (and N to a multiple of it too)."""
    b, T = input_ids.shape
    lens = seq_lens.to(torch.long).cpu()
    mask = torch.arange(T)[None] < lens[:, None]  # [b, T] real tokens
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: row 0's tokens, then row 1's ...
    seg = lens if cp == 1 else (lens + 2 * cp - 1) // (2 * cp) * (2 * cp)
    used = int(seg.sum())
    step = multiple if cp == 1 else math.lcm(multiple, 2 * cp)
    total = -(-used // step) * step
    tail = total - used
    starts = torch.cumsum(seg, 0) - seg
    ids = torch.zeros((1, total), dtype=input_ids.dtype)
    ids[0, starts[rows] + cols] = input_ids.cpu()[rows, cols]
    seg_of = torch.repeat_interleave(torch.arange(b), seg)  # [used] segment (row) of each packed position
    pos = torch.cat([torch.arange(used) - starts[seg_of], torch.arange(tail)])[None]
    bounds = [0, *torch.cumsum(seg, 0).tolist()] + ([total] if tail else [])
    return ThdBatch(
        input_ids=ids.to(input_ids.device),
        position_ids=pos.to(input_ids.device),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=input_ids.device),
        max_seqlen=int(max(int(seg.max()), tail)),
        rows=rows,
        cols=cols,
        shape=(b, T),
        cp=cp,
    )


def use_thd(dynamic_batching: bool, device: torch.device, ep_size: int = 1) -> bool:
    """THD packing: with dynamic batching, on CPU (actor/attention.py) or on GPU where Transformer
    Engine imports (the layer spec is then TE's, whose attention reads ``packed_seq_params``). MoE
    routing replay hands the routers their experts in packed order (actor/moe/routing.py ``replay_order``).
    Not with expert parallelism on CPU: megatron's all-gather token dispatcher needs the same token count
    on every EP rank, which padded micro-batches give and packed ones (each rank its own rows' tokens) do
    not (gloo aborted on the size mismatch in tests/rollout/test_vllm_moe_train.py). Under context
    parallelism each row is padded and split over the CP ranks (:func:`pack_thd`; on GPU: never run)."""
    from pacs_megatron.actor.model import have_transformer_engine

    if not dynamic_batching or (ep_size > 1 and device.type == "cpu"):
        return False
    return device.type == "cpu" or (device.type == "cuda" and have_transformer_engine())
