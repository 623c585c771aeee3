"""The context-parallel split of a sequence: megatron's load-balanced zig-zag, as index maths in pure torch.

A sequence of S tokens (S a multiple of 2 * cp) is cut into 2 * cp equal chunks; CP rank i holds chunks
i and 2*cp-1-i, so every rank has as many early (cheap) as late (expensive) causal queries. Rows are never
split: the batch dimension stays whole on every rank. This is the order megatron's RoPE slices its
frequencies in (``get_pos_emb_on_this_cp_rank``) and Transformer Engine's CP attention expects.

    S = 8, cp = 2: chunks [0 1][2 3][4 5][6 7] -> rank 0 holds positions [0 1 6 7], rank 1 [2 3 4 5]

Padded batches are padded to a multiple of 2 * cp (:func:`padded_length`); the collectives that move
chunks between ranks are parallel/cp_comm.py's.
"""

from __future__ import annotations

import torch


def padded_length(length: int, cp: int) -> int:
    """``length`` rounded up to a multiple of ``2 * cp`` (what the split takes)."""
    return -(-length // (2 * cp)) * (2 * cp)


def chunk_positions(length: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[length // cp]`` int64: the positions of a ``length``-token sequence that CP rank ``rank`` holds.

    Example:
        >>> chunk_positions(8, 2, 0).tolist(), chunk_positions(8, 2, 1).tolist()
        ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} outside a CP group of {cp}")
    if length % (2 * cp):
        raise ValueError(
            f"a sequence of {length} tokens does not split into 2 * parallel.cp = {2 * cp} equal chunks: pad it to "
            f"{padded_length(length, cp)} (parallel/cp_split.py padded_length)"
        )
    c = length // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def gathered_positions(length: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[length]`` int64: the positions of the CP ranks' chunks concatenated in rank order (what an
    all-gather over the CP group holds)."""
    return torch.cat([chunk_positions(length, cp, r, device) for r in range(cp)])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of ``x`` along ``dim`` (whose size must be a multiple of ``2 * cp``)."""
    if cp == 1:
        return x
    return x.index_select(dim, chunk_positions(x.shape[dim], cp, rank, x.device))


def unsplit_sequence(gathered: torch.Tensor, cp: int, dim: int = 1) -> torch.Tensor:
    """The sequence in its natural order from the ranks' chunks concatenated in rank order along ``dim``
    (the inverse of :func:`split_sequence` over all ranks); differentiable."""
    if cp == 1:
        return gathered
    order = torch.argsort(gathered_positions(gathered.shape[dim], cp, gathered.device))
    return gathered.index_select(dim, order)


def causal_allowed(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``[len(q_pos), len(k_pos)]`` bool, True where a query may attend to a key (key position <= query's):
    the causal mask of a split sequence, built from global positions."""
    return k_pos[None, :] <= q_pos[:, None]


def pad_to_split(x: torch.Tensor, cp: int, value: float | int = 0, dim: int = 1) -> torch.Tensor:
    """``x`` right-padded with ``value`` along ``dim`` to :func:`padded_length` (unchanged when it fits)."""
    extra = padded_length(x.shape[dim], cp) - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def thd_chunk_index(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """``[N // cp]`` int64: the packed positions CP rank ``rank`` holds of a THD sequence whose segments
    (``cu_seqlens [segments + 1]``, each a multiple of ``2 * cp`` long) are split one by one: the rank's two
    chunks of segment 0, then of segment 1, ... (Transformer Engine's THD layout under CP)."""
    bounds = cu_seqlens.to(torch.long).cpu().tolist()
    parts = [start + chunk_positions(end - start, cp, rank) for start, end in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def thd_gathered_index(cu_seqlens: torch.Tensor, cp: int) -> torch.Tensor:
    """``[N]`` int64: the packed positions of the CP ranks' THD tokens concatenated in rank order."""
    return torch.cat([thd_chunk_index(cu_seqlens, cp, r) for r in range(cp)])
