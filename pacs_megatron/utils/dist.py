"""Tiny helpers over the default process group for the trainer's host-side work (rollouts,
rewards, metrics). Model-parallel groups live in ``parallel/``; these never touch megatron."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def under_launcher() -> bool:
    """True inside a rank started by a launcher (torchrun, Slurm, Ray, or the local spawner)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A TCP port free on every interface: torch's TCPStore listens on all of them, so a port free on
    127.0.0.1 only (another job's on the machine's address) would fail with EADDRINUSE."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous ``[start, stop)`` of ``n`` items for ``rank`` of ``size`` (sizes differ by <= 1)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a one-element list without a process group)."""
    rank, world = rank_and_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def map_sharded(
    items: Sequence[T], fn: Callable[[Sequence[T]], list[Any]], rank: int | None = None, size: int | None = None
) -> list[Any]:
    """Apply ``fn`` to this worker's contiguous share of ``items`` and gather all results in order.

    ``rank``/``size`` name the worker among ``size`` workers (default: the process group); when several
    ranks form one worker (an engine spanning a TP group) they pass the same ``rank`` and the first
    copy of each worker's result is kept.
    """
    grank, gworld = rank_and_world()
    rank = grank if rank is None else rank
    size = gworld if size is None else size
    start, stop = shard_bounds(len(items), rank, size)
    local = fn(items[start:stop])
    if len(local) != stop - start:
        raise RuntimeError(f"map_sharded: fn returned {len(local)} results for {stop - start} items")
    per_worker: dict[int, list[Any]] = {}
    for r, part in all_gather_objects((rank, local)):
        per_worker.setdefault(r, part)
    if sorted(per_worker) != list(range(size)):
        raise RuntimeError(f"map_sharded: results from workers {sorted(per_worker)}, expected 0..{size - 1}")
    return [x for r in range(size) for x in per_worker[r]]
