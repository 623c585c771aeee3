"""An endless, deterministic, resumable stream of prompts over a fixed list of records.

Epoch ``e`` visits every record once in the order ``permutation(seed, e)`` (or file order with
``shuffle=False``); ``next_batch(k)`` takes the next ``k`` records, crossing into the next epoch as
needed, so a batch may hold a record twice when ``k`` exceeds the dataset (50 prompts from 25
problems: each problem once from epoch e and once from epoch e+1). The whole state is
``(epoch, position)``: restoring it reproduces the exact batches of the uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pacs_megatron.data.records import PromptRecord


class PromptDataset:
    """Prompts for training, drawn epoch by epoch.

    Example:
        >>> recs = [PromptRecord(str(i), "", "", (i,), "", "t") for i in range(3)]
        >>> ds = PromptDataset(recs, seed=0, shuffle=False)
        >>> [r.id for r in ds.next_batch(4)], ds.state_dict()["epoch"], ds.state_dict()["position"]
        (['0', '1', '2', '0'], 1, 1)
    """

    def __init__(self, records: Sequence[PromptRecord], seed: int = 42, shuffle: bool = True, name: str = "") -> None:
        if not records:
            raise ValueError(f"dataset {name!r} is empty")
        self.records = list(records)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.name = name
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.records)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.records)
        if not self.shuffle:
            return np.arange(n)
        # A generator seeded by (seed, epoch): the order of epoch e never depends on how we got there.
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self, num_prompts: int) -> list[PromptRecord]:
        """The next ``num_prompts`` records (any number, crossing epochs as needed)."""
        if num_prompts < 0:
            raise ValueError(f"num_prompts={num_prompts} must be >= 0")
        out: list[PromptRecord] = []
        while len(out) < num_prompts:
            take = min(num_prompts - len(out), len(self.records) - self.position)
            out.extend(self.records[i] for i in self._order[self.position : self.position + take])
            self.position += take
            if self.position == len(self.records):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the stream (plain ints, JSON-serialisable)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_records": len(self.records),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses a state taken on a different dataset or seed."""
        for key, mine in (("num_records", len(self.records)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"dataset {self.name!r}: checkpoint has {key}={state[key]!r} but this run has {mine!r}; "
                    "resuming would change the prompt stream (use the same data config, or start fresh)"
                )
        position = int(state["position"])
        if not 0 <= position < len(self.records):
            raise ValueError(f"dataset {self.name!r}: position {position} outside 0..{len(self.records) - 1}")
        self.epoch = int(state["epoch"])
        self.position = position
        self._order = self._epoch_order(self.epoch)
