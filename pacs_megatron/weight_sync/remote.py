"""Weight sync to engines on their own ranks (``rollout.placement=separate``): the data plane, and the
:class:`RemoteWeightSync` that drives it and verifies every version on the engine side.

    trainer ranks       actor.export_hf_weights() -> (quantizer) -> iter_buckets   (collective, as colocated;
      of CP rank 0      a CP rank > 0 shares none of rank 0's TP and PP groups: it skips the export)
    trainer rank 0      pack each bucket into ONE host byte buffer (the staged copy: the trainer goes on
                        training) -> LoadWeights(version, layout, probe) queued behind each engine's earlier
                        commands -> the sender thread broadcasts the buffers once every engine reached that
                        LoadWeights (WeightsWanted)
    every trainer rank  the actor's probe log-probs of this version, kept until the engines answer
    engine e            receive the same buffers -> views by the layout -> update_weights -> the probe's
                        log-probs -> Loaded(version, log-probs)
    verify              rank 0 compares each engine's log-probs with the actor's of that version; every rank
                        raises WeightSyncError above sync.probe_tolerance

The push returns once the weights are staged; a version is verified when the first samples drawn with it are
taken, and with ``wait=True`` (k = 0, the last step) the push waits for it. The group, the byte buffers and
what staging costs: docs/async.md, "Processes and weights".
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.rollout.base import PROBE_LEN
from pacs_megatron.rollout.remote.engines import RemoteEngines, broadcast_from_rank0
from pacs_megatron.rollout.weight_checksum import Recorder
from pacs_megatron.utils.logging import get_logger
from pacs_megatron.weight_sync.buckets import iter_buckets
from pacs_megatron.weight_sync.sync import SyncResult, WeightSync, raise_bitwise, random_probe_batch

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


class RemoteWeightSync(WeightSync):
    """:class:`~pacs_megatron.weight_sync.sync.WeightSync` through the weight group of ``engines``."""

    def __init__(self, actor, engines: RemoteEngines, cfg, vocab_size: int, param_dtype, rollout, device) -> None:
        """Collective: trainer rank 0 joins the weight group (the engines join it once built)."""
        super().__init__(actor, engines, cfg, vocab_size, param_dtype, rollout)
        # The colocated probe's greedy part is the engine's continuation under the new weights, scored by the actor
        # holding them; here the actor has moved on by the time an engine answers. So each engine also returns its
        # greedy continuation of the probe's prompts, and the next version's probe continues them with it (rows
        # the model predicted one version earlier: still tokens it predicts, at |logp| of a few nats), where the
        # greedy bound applies. Until the first answer the probe is random tokens only (relative bound).
        self.probe = random_probe_batch(vocab_size, cfg.probe_sequences) if cfg.probe_sequences else None
        self.continuation: list[list[int]] | None = None
        """The latest greedy continuation of the probe's prompts an engine returned (the same on every rank)."""
        self.engines = engines
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor, Rollouts]] = {}
        """version -> (actor, reference) probe log-probs and the probe, until every engine's Loaded was compared."""
        self.sent: dict[int, dict] = {}
        """Trainer rank 0, sync.verify_bitwise: version -> fingerprints of the tensors sent (as sent)."""
        self._answers: dict[int, int] = {}
        self._bitwise_s = math.nan  # rank 0's fingerprinting of the last version pushed
        self.bitwise_tensors = 0
        """Tensors every engine verified bit for bit, of the version the last :meth:`sync` waited for."""
        self.greedy_logprob_diff = math.nan
        """The probe's greedy mean of the version the last :meth:`sync` waited for (nan: none yet)."""
        self.engine_bitwise_s = 0.0
        self.sender = None
        self.device = torch.device(device)
        if engines.rank == 0:
            group = WeightGroup(engines.backend, engines.store, 0, 1 + engines.count, device, engines.timeout_s)
            self.sender = WeightSender(group, engines.wait_wanted)
        # rank 0's TP and PP groups hold no rank of another CP rank (MoE, whose EP groups could, is refused at
        # cp > 1): the CP ranks > 0 skip the export together, unless their quantized probe needs its tensors
        self.exports = actor.groups.cp_rank == 0 or (self.quantizer is not None and self.prompts is not None)
        """This rank runs the export (collective over its TP and PP groups)."""

    def push_version(self, version: int) -> SyncResult:
        """Stage the actor's weights as ``version`` and queue them for the engines (collective; no waiting).
        The bytes and buckets are those this rank exported: none where :attr:`exports` is off."""
        start = time.perf_counter()
        layout, buffers, total, count = [], [], 0, 0
        pin = self.device.type == "cuda"
        # the engines fingerprint what they receive and hold; rank 0 what it sends, in the same dtype
        recorder = Recorder() if self.cfg.verify_bitwise and self.sender is not None else None
        buckets = iter_buckets(self._stream() if self.exports else iter(()), self.bucket_bytes, self.send_dtype)
        for bucket in recorder.buckets(buckets) if recorder else buckets:
            total += sum(t.numel() * t.element_size() for _, t in bucket)
            count += 1
            if self.sender is not None:
                entry, buf = pack(bucket, pin=pin)
                layout.append(entry)
                buffers.append(buf)
        if self.probe is not None and self.continuation is not None:
            half = PROBE_LEN // 2
            prompts = [row[:half].tolist() for row in self.probe.input_ids]
            self.probe = build_rollouts(prompts, self.continuation, [0.0] * len(prompts), 1, pad_id=0)
        probe = self.probe_sequences() if self.probe is not None else []
        if self.sender is not None:
            self.engines.send_load(version, layout, probe)
            self.sender.send(version, buffers)
        if self.probe is not None:
            self.pending[version] = (*self.reference_logprobs(), self.probe)
        if recorder is not None:
            self.sent[version] = recorder.sums
        self._bitwise_s = recorder.seconds if recorder else math.nan
        return SyncResult(time.perf_counter() - start, total / 1e9, float("nan"), count)

    def _bitwise(self, m) -> tuple[float, int, str, int]:
        """Rank 0: ``(the engine's seconds on it, tensors verified, first tensor that differs, how many)`` for one
        engine's Loaded reply ``m``:
        what it received against what was sent (the transport), then what it holds against what arrived (its load).
        """
        report, sent = m.bitwise, self.sent.get(m.version)
        if report is None or sent is None:
            return math.nan, 0, "", 0
        bad = [n for n, c in sent.items() if report.received.get(n) != c] + list(report.differs)
        return report.seconds, len(sent) - len(report.unverified), (bad[0] if bad else ""), len(bad)

    def verify(self, upto: int) -> tuple[float, float]:
        """Collective: check the loads the engines answered for every version <= ``upto`` (waiting for all of
        ``upto``'s, when still pending): bit for bit (raises WeightSyncError naming the first tensor that differs),
        then their probes against the actor's (raises above a tolerance). Returns ``(max diff, max quantization
        gap)``, nan when no probe was compared. Keeps the newest greedy continuation for the next version's probe."""
        payload = None
        if self.sender is not None:
            waiting = upto in self.pending or upto in self.sent
            needed = self.engines.count - self._answers.get(upto, 0) if waiting else 0
            loaded = self.engines.take_loaded(upto, needed)
            nan4 = (math.nan, math.nan, math.nan, math.nan)
            rows = [
                (
                    m.version,
                    m.engine,
                    *(self._probe_row(m) if m.version in self.pending else nan4),
                    *self._bitwise(m),
                )
                for m in loaded
            ]
            newest = max(loaded, key=lambda m: m.version, default=None)
            payload = (rows, newest.probe_continuation if newest is not None and newest.probe_continuation else None)
        rows, continuation = broadcast_from_rank0(payload)
        if continuation is not None:
            self.continuation = continuation
        for version, *_ in rows:
            self._answers[version] = self._answers.get(version, 0) + 1
            if self._answers[version] == self.engines.count:
                self.pending.pop(version, None)
                self.sent.pop(version, None)
                del self._answers[version]
        for version, engine, *_, engine_s, verified, first, count in rows:
            if count:
                raise_bitwise(first, count, f"engine {engine}, version {version}")
            if version == upto:
                self.bitwise_tensors = min(self.bitwise_tensors, verified)
                self.engine_bitwise_s = max(self.engine_bitwise_s, engine_s)
        compared = [r for r in rows if not math.isnan(r[3])]
        if not compared:
            return math.nan, math.nan
        worst = max(compared, key=lambda r: r[3])
        greedy = max((r[4] for r in compared if not math.isnan(r[4])), default=math.nan)
        self.raise_if_off(worst[2], worst[3], greedy)
        if upto in {r[0] for r in compared}:
            self.greedy_logprob_diff = greedy
        return worst[2], max(r[5] for r in compared)

    def _probe_row(self, m) -> tuple[float, float, float, float]:
        """Rank 0: :meth:`compare` of one engine's probe log-probs of version ``m.version``; the greedy mean is nan
        when that version's probe had no continuation yet."""
        actor_lp, ref_lp, probe = self.pending[m.version]
        diff, scaled, greedy, gap = self.compare(m.probe_logprobs, actor_lp, ref_lp, probe)
        return diff, scaled, greedy if bool(probe.response_mask.any()) else math.nan, gap

    def sync(self, version: int = 0, wait: bool = True) -> SyncResult:
        """Push ``version``; with ``wait`` wait for every engine's probe of it and verify (raises above the
        tolerance), as the colocated sync does; without, ``max_logprob_diff`` is nan (verified later, when the
        first samples of ``version`` are taken)."""
        pushed = self.push_version(version)
        self.bitwise_tensors = 1 << 62  # the least any engine verified of this version (verify sets it)
        self.greedy_logprob_diff = math.nan
        self.engine_bitwise_s = 0.0  # the slowest engine's time on the check (verify sets it)
        diff, gap = self.verify(version) if wait else (math.nan, math.nan)
        verified = self.bitwise_tensors if self.bitwise_tensors < 1 << 62 else 0
        greedy = self.greedy_logprob_diff
        bitwise_s = self._bitwise_s + self.engine_bitwise_s  # the sender's fingerprints, then the engines'
        return SyncResult(pushed.seconds, pushed.gbytes, diff, pushed.buckets, gap, greedy, bitwise_s, verified)
