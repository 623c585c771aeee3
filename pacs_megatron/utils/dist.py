"""Tiny helpers over the default process group for the trainer's host-side work (rollouts,
rewards, metrics). Model-parallel groups live in ``parallel/``; these never touch megatron."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def under_launcher() -> bool:
    """True inside a rank started by a launcher (torchrun, Slurm, Ray, or the local spawner)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


_PORTS_FROM = 20000
"""Reserved ports start here: above the fixed ports of common services and Ray's default worker range (10002-19999)."""


def _ephemeral_start() -> int:
    """First port of the kernel's ephemeral range (the ports ``bind(port 0)`` and ``connect`` hand out)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS and Windows start at 49152


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports, each free on every interface (torch's TCPStore and Ray listen on all of
    them, so a port free on 127.0.0.1 only, another job's on the machine's address, would fail with
    EADDRINUSE).

    All ``n`` are held at once while they are chosen, so no two are equal: ports picked one at a time
    can repeat (18 of 20,000 runs of six ``bind(port 0)`` calls gave a duplicate here), and Ray refuses
    a port named twice (ray-project/ray#45484). They are drawn at random below the kernel's ephemeral
    range, where no port-0 bind or outgoing connection (of a process Ray starts meanwhile, say) takes
    one before its user binds it, and not from the seedable ``random``: two processes seeded alike
    would draw the same ports. The kernel's own picks are the fallback where that range is too small.
    """
    low, high = _PORTS_FROM, _ephemeral_start()
    held: list[socket.socket] = []
    try:
        tries = 0
        while len(held) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            port = random.SystemRandom().randrange(low, high) if high - low >= 1000 and tries < 1000 else 0
            tries += 1
            try:
                s.bind(("", port))
            except OSError:  # in use (or held by this call already)
                s.close()
                continue
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1)[0]


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist  # here: the launcher imports this module and no torch

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
    import torch.distributed as dist

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
