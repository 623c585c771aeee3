"""MoE routing replay records of a batch, held compactly and only by the ranks that train on them.

The engine records, per response, the experts each token went to: ``[prompt + response tokens, L, k]``
(rollout ``Response.routed_experts``), large at recipe scale. Here:

- the records stay unpadded, one ``[len_b, L, k]`` tensor per row, in uint8 (<= 256 experts) or int16;
- rollout/collect.py gathers responses without them: each rank keeps its engine replica's records, and
  :func:`fetch_routed_experts` (collective) hands every rank those of the rows it trains on after the
  data-parallel split;
- the padded ``[b, T, L, k]`` indices exist per micro-batch only (:meth:`RoutedExperts.padded`, called by
  actor/forward.py), and megatron's int64 per-router indices per layer only (actor/moe/routing.py).

The sizes at the 30B recipe's scale, before and after: docs/models.md, "Routing replay (R3)".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pacs_megatron.utils.dist import all_gather_objects, rank_and_world


def compact(record: torch.Tensor) -> torch.Tensor:
    """A record in the smallest integer dtype that holds its expert ids (uint8 up to 255, else int16)."""
    if record.numel() and int(record.max()) > 255:
        return record.to(torch.int16)
    return record.to(torch.uint8)


@dataclass(frozen=True)
class RoutedExperts:
    """The routing records of a batch's rows: ``records[j]`` is row j's ``[len_j, L, k]`` (or None where
    another rank holds it), ``rows[j]`` its row id in the step's batch.

    Example:
        >>> r = RoutedExperts.from_records([torch.tensor([[[1, 2]]]), None])
        >>> r.take(torch.tensor([0])).padded(3)[:, :, 0].tolist()  # padding positions: experts 0..k-1
        [[[1, 2], [0, 1], [0, 1]]]
    """

    rows: torch.Tensor
    """``[B]`` int64 row ids within the step's batch (the key of the exchange)."""
    records: tuple[torch.Tensor | None, ...]
    """Per row: ``[len, L, k]`` uint8/int16 experts of every token (prompt + response), or None."""

    @staticmethod
    def from_records(records: Sequence[torch.Tensor | None], seq_lens: torch.Tensor | None = None) -> RoutedExperts:
        """The step's batch: row j is ``records[j]`` (compacted; None: held by another rank), checked
        against the rows' ``seq_lens`` (prompt + response tokens) when given."""
        for j, r in enumerate(records):
            if r is not None and seq_lens is not None and r.shape[0] != int(seq_lens[j]):
                raise ValueError(f"row {j}: routed experts for {r.shape[0]} tokens, the row has {int(seq_lens[j])}")
        return RoutedExperts(torch.arange(len(records)), tuple(None if r is None else compact(r) for r in records))

    def __len__(self) -> int:
        return len(self.records)

    def take(self, rows: torch.Tensor) -> RoutedExperts:
        """The records of batch positions ``rows`` (a Rollouts row selection)."""
        idx = rows.tolist()
        return RoutedExperts(self.rows[rows], tuple(self.records[i] for i in idx))

    @property
    def nbytes(self) -> int:
        """Bytes of the records held here."""
        return sum(r.numel() * r.element_size() for r in self.records if r is not None)

    def padded(self, width: int) -> torch.Tensor:
        """``[b, width, L, k]`` (the records' dtype) of a micro-batch: row j's record on its first
        positions, experts 0..k-1 at padding (k distinct experts; causality keeps them from mattering)."""
        missing = [int(self.rows[j]) for j, r in enumerate(self.records) if r is None]
        if missing:
            raise RuntimeError(f"routing replay: rows {missing[:8]} have no routing record on this rank")
        first = self.records[0]
        L, k = first.shape[1:]
        out = torch.arange(k, dtype=first.dtype).expand(len(self), width, L, k).clone()
        for j, r in enumerate(self.records):
            n = min(r.shape[0], width)
            out[j, :n] = r[:n]
        return out


def fetch_routed_experts(held: RoutedExperts, wanted: RoutedExperts) -> RoutedExperts:
    """``wanted``'s rows with their records, from the ranks that hold them in ``held`` (collective over
    the default process group; every rank calls it with its own ``wanted``). Each record travels once,
    from the lowest rank holding it to each rank that wants it."""
    _, world = rank_and_world()
    mine = {int(r): rec for r, rec in zip(held.rows.tolist(), held.records) if rec is not None}
    if world > 1:
        rank = dist.get_rank()
        want = all_gather_objects(sorted(set(wanted.rows.tolist())))
        owner: dict[int, int] = {}
        for src, rows in enumerate(all_gather_objects(sorted(mine))):
            for row in rows:
                owner.setdefault(row, src)
        got: dict[int, torch.Tensor] = {}
        for src in range(world):  # one scatter per source: only the records a rank asked for move
            payload = None
            if rank == src:
                payload = [{r: mine[r] for r in want[dst] if owner.get(r) == src} for dst in range(world)]
            box: list = [None]
            dist.scatter_object_list(box, payload, src=src)
            got.update(box[0])
        mine = got
    records = tuple(mine.get(r) for r in wanted.rows.tolist())
    missing = [r for r, rec in zip(wanted.rows.tolist(), records) if rec is None]
    if missing:
        raise RuntimeError(f"routing replay: no rank holds the routing records of rows {missing[:8]}")
    return RoutedExperts(wanted.rows, records)
