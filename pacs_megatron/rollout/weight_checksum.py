"""Bitwise weight verification: an exact, cheap checksum per tensor, composable across fused layouts.

    words    the tensor's bytes viewed as signed integers of its element size (bf16 -> int16, fp32 -> int32),
             as ``[rows, -1]`` with rows = shape[0] (a 1-D tensor: one row per element)
    row sums s_r = sum of row r's words                  (int64)
    checksum (rows, sum_r s_r, sum_r (r + 1) * s_r)     mod 2^64

Integer sums are exact in any reduction order, device or thread count; the row-weighted sum also sees rows
that moved (a q/k/v mix-up). A dim-0 concatenation's checksum follows from its parts' (:func:`combine`), so
no fused tensor is built. -0.0 and +0.0 count equal, and floating tensors are fingerprinted in the engine's
``dtype``. Why each choice: docs/weight_sync.md, "The bitwise check".
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

MASK = (1 << 64) - 1
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Checksum:
    """The fingerprint of one tensor (or of a concatenation along dim 0: :func:`combine`).

    Example:
        >>> a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -0.0]])
        >>> combine([checksum(a), checksum(b)]) == checksum(torch.cat([a, b]))
        True
        >>> checksum(b) == checksum(torch.tensor([[3.0, 0.0]]))  # signed zeros count equal
        True
    """

    rows: int
    """Size of dim 0 (1 for a 0-d tensor)."""
    total: int
    """Sum of every word, mod 2^64."""
    weighted: int
    """Sum of (row index + 1) x row sum, mod 2^64."""


def _words(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``[rows, cols]`` signed integer view of ``t``'s bytes (cast to ``dtype`` first when floating)."""
    t = t.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    t = t.contiguous()
    rows = t.shape[0] if t.dim() else 1
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    words = t.view(_WORDS[t.element_size()]).reshape(rows, -1)
    if t.is_floating_point():  # -0.0 is the word with only the sign bit set: the integer minimum
        words = words.masked_fill(words == torch.iinfo(words.dtype).min, 0)
    return words


def row_sums(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[rows]`` int64: the sum of each dim-0 row's words (see the module docstring)."""
    return _words(t, dtype).sum(1, dtype=torch.int64)


def from_row_sums(s: torch.Tensor) -> Checksum:
    """The :class:`Checksum` of a tensor whose :func:`row_sums` are ``s``."""
    s = s.to(torch.int64)
    idx = torch.arange(1, s.numel() + 1, dtype=torch.int64, device=s.device)
    return Checksum(s.numel(), int(s.sum()) & MASK, int((s * idx).sum()) & MASK)


def checksum(t: torch.Tensor, dtype: torch.dtype | None = None) -> Checksum:
    """The fingerprint of ``t`` as held in ``dtype`` (floating tensors; None: as it is).

    Example:
        >>> x = torch.randn(4, 3)
        >>> checksum(x) == checksum(x.clone()), checksum(x) == checksum(x.flip(0))
        (True, False)
    """
    return from_row_sums(row_sums(t, dtype))


def combine(parts: Sequence[Checksum]) -> Checksum:
    """The fingerprint of the concatenation of ``parts`` along dim 0 (in order), from theirs alone: row r of
    part k sits at row ``offset_k + r`` of the whole, adding ``offset_k x total_k`` to the weighted sum."""
    rows = total = weighted = 0
    for p in parts:
        total += p.total
        weighted += p.weighted + rows * p.total
        rows += p.rows
    return Checksum(rows, total & MASK, weighted & MASK)


@dataclass(frozen=True)
class Held:
    """What an engine reports for one tensor it holds: the HF tensors it is made of and its fingerprint.

    Example:
        >>> Held("l0.qkv_proj.weight", ("l0.q_proj.weight", "l0.k_proj.weight"), Checksum(2, 3, 4)).parts
        ('l0.q_proj.weight', 'l0.k_proj.weight')
    """

    name: str
    """The engine's name of the tensor (an HF name, or a fused vLLM parameter's)."""
    parts: tuple[str, ...]
    """The HF tensors concatenated along dim 0 to make it, in order (one for an unfused tensor)."""
    checksum: Checksum
    """Its fingerprint as the engine holds it (vocab padding rows cut off)."""


class Recorder:
    """Passes a stream of buckets through, fingerprinting every tensor in ``dtype`` (None: as it travels).

    Example:
        >>> rec = Recorder(torch.bfloat16)
        >>> [n for b in rec.buckets([[("w", torch.ones(2, 2))]]) for n, _ in b], rec.sums["w"].rows
        (['w'], 2)
    """

    def __init__(self, dtype: torch.dtype | None = None, wire: bool = False) -> None:
        """``wire``: also keep each tensor's fingerprint as it travels (:attr:`wire_sums`)."""
        self.dtype, self.wire = dtype, wire
        self.sums: dict[str, Checksum] = {}
        """Name -> fingerprint in :attr:`dtype`."""
        self.wire_sums: dict[str, Checksum] = {}
        """Name -> fingerprint as received (only with ``wire``)."""
        self.seconds = 0.0
        """Time spent fingerprinting."""

    def buckets(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]):
        for bucket in buckets:
            start = time.perf_counter()
            for name, t in bucket:
                self.sums[name] = checksum(t, self.dtype)
                if self.wire:
                    # the same numbers when the tensor already travels in dtype: no second pass
                    same = self.dtype is None or not t.is_floating_point() or t.dtype == self.dtype
                    self.wire_sums[name] = self.sums[name] if same else checksum(t)
            self.seconds += time.perf_counter() - start
            yield bucket


@dataclass(frozen=True)
class Report:
    """An engine's verdict on one load (rollout.placement=separate: sent back with the load's reply).

    Example:
        >>> Report({}, ["model.norm.weight"], []).differs
        ['model.norm.weight']
    """

    received: dict[str, Checksum]
    """Fingerprint of every tensor as it arrived (in the sender's dtype): the trainer compares them with
    what it sent (the transport)."""
    differs: list[str]
    """Held tensors that differ from what arrived, cast to the engine's dtype (the load), in the order held."""
    unverified: list[str]
    """Received tensors no held tensor covers (e.g. MoE experts in vLLM's prepacked layout, a tied alias)."""
    seconds: float = 0.0
    """The engine's time on the check: fingerprinting what arrived, reading back what it holds, comparing."""


def compare(sent: dict[str, Checksum], held: Iterable[Held]) -> tuple[list[str], list[str]]:
    """``(the held tensors that differ from what was sent, in the order held, the sent names no held tensor
    covers)``. A held tensor with a part that was not sent is not compared (it covers nothing): an engine
    parameter without an HF counterpart. Completeness of the sync is the engines' own check (by name)."""
    bad: list[str] = []
    covered: set[str] = set()
    for h in held:
        if any(p not in sent for p in h.parts):
            continue
        covered.update(h.parts)
        if combine([sent[p] for p in h.parts]) != h.checksum:
            bad.append(h.name if h.parts == (h.name,) else f"{h.name} (= {' + '.join(h.parts)})")
    return bad, [n for n in sent if n not in covered]
