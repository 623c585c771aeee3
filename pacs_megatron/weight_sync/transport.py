"""The weights' data plane to engines on other ranks (``rollout.placement=separate``): a process group of
trainer rank 0 and the engine processes, bucketed as the colocated sync is.

    trainer rank 0   export stream -> iter_buckets (sync.bucket_mb) -> pack: each bucket into ONE byte buffer
                     on the host (the staged copy; the trainer goes on training) -> sender thread: once every
                     engine reached the LoadWeights (WeightsWanted), broadcast the buffers in order
    engine e         LoadWeights(layout) -> receive the same buffers -> views by the layout -> update_weights

The group: rank 0 is trainer rank 0, rank 1 + e is engine e, made from the trainer job's TCPStore under
its own prefix (no default group is touched on either side: vLLM's in-process workers have their own).
gloo on CPU; NCCL on GPU, where each buffer goes to the GPU before its broadcast (the NCCL path is written
for GPU, never run). A bucket travels as bytes, so any dtype mix crosses gloo and NCCL alike; the sender
starts a broadcast only once every engine waits for it, so an NCCL kernel never spins on the trainer's
GPU while the engines are still generating.

Staging costs one host copy of the weights per version not yet received (at most ``max_staleness``
in steady state): 14 GB per copy for a 7B model in bf16.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

PREFIX = "pacs_rollout/weights"
_ALIGN = 64  # every tensor starts at a multiple of this many bytes: a view of any dtype is aligned

Layout = list[tuple[str, tuple[int, ...], str, int]]
"""One bucket: (name, shape, dtype name, byte offset) per tensor."""


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def pack(bucket: Iterable[tuple[str, torch.Tensor]], pin: bool = False) -> tuple[Layout, torch.Tensor]:
    """One host byte buffer holding every tensor of ``bucket``, and its layout.

    Example:
        >>> layout, buf = pack([("a", torch.ones(2)), ("b", torch.arange(3, dtype=torch.int16))])
        >>> [(n, s, d, o) for n, s, d, o in layout], buf.numel()
        ([('a', (2,), 'float32', 0), ('b', (3,), 'int16', 64)], 70)
        >>> [t.tolist() for _, t in unpack(layout, buf)]
        [[1.0, 1.0], [0, 1, 2]]
    """
    items = list(bucket)
    layout: Layout = []
    offset = 0
    for name, t in items:
        offset = -(-offset // _ALIGN) * _ALIGN
        layout.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset))
        offset += t.numel() * t.element_size()
    buf = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
    for (_, t), (_, _, _, off) in zip(items, layout):
        raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
        buf[off : off + raw.numel()].copy_(raw)
    return layout, buf


def unpack(layout: Layout, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one bucket, as views of ``buf`` (see :func:`pack`)."""
    out = []
    for name, shape, dtype, off in layout:
        dt = _dtype(dtype)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dt).element_size()
        out.append((name, buf[off : off + nbytes].view(dt).view(shape)))
    return out


def nbytes(layout: Layout) -> int:
    """The byte size of a bucket's buffer."""
    if not layout:
        return 0
    name, shape, dtype, off = layout[-1]
    numel = 1
    for d in shape:
        numel *= d
    return off + numel * torch.empty((), dtype=_dtype(dtype)).element_size()


class WeightGroup:
    """The process group of trainer rank 0 (rank 0) and the engines (1 + index)."""

    def __init__(self, backend: str, store, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
        """Collective over the group's ``size`` processes: joins (blocks until all have)."""
        self.device = torch.device(device)
        prefixed = dist.PrefixStore(PREFIX, store)
        timeout = timedelta(seconds=timeout_s)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        elif backend == "nccl":  # written for GPU, never run
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        else:
            raise ValueError(f"weight group backend {backend!r}: use gloo or nccl")
        self.backend = backend

    def broadcast(self, buf: torch.Tensor) -> None:
        """Broadcast ``buf`` (in place) from the trainer (rank 0) to every engine."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([buf], opts).wait()

    def to_wire(self, buf: torch.Tensor) -> torch.Tensor:
        return buf if self.backend == "gloo" else buf.to(self.device, non_blocking=True)


def receive_buckets(group: WeightGroup, layout: list[Layout]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Engine: the buckets of one LoadWeights, received one at a time (one buffer alive at once)."""
    for bucket in layout:
        buf = torch.empty(nbytes(bucket), dtype=torch.uint8, device=group.device if group.backend == "nccl" else "cpu")
        group.broadcast(buf)
        yield unpack(bucket, buf)


class WeightSender:
    """Trainer rank 0: broadcasts staged versions in order from a thread, each once the engines want it.

    ``wanted(version)`` blocks until every engine reached that version's LoadWeights (RemoteEngines.wait_wanted).
    An error in the thread is raised by the next :meth:`send` or :meth:`drain`.
    """

    def __init__(self, group: WeightGroup, wanted) -> None:
        self.group, self.wanted = group, wanted
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="weight-sender")
        self.thread.start()

    def send(self, version: int, buffers: list[torch.Tensor]) -> None:
        self._raise()
        self.queue.put((version, buffers))

    def drain(self) -> None:
        """Until every queued version was broadcast."""
        self.queue.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight sender failed: {self.error}") from self.error

    def _run(self) -> None:
        while True:
            version, buffers = self.queue.get()
            try:
                if self.error is None:
                    self.wanted(version)
                    for buf in buffers:
                        self.group.broadcast(self.group.to_wire(buf))
            except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread
                self.error = e
                logger.error("weight sender: version %d failed: %s", version, e)
            finally:
                self.queue.task_done()
