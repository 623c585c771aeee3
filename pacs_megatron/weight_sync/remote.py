"""Weight sync to engines on their own ranks (``rollout.placement=separate``), verified on the engine side.

    every trainer rank   actor.export_hf_weights() -> (quantizer) -> iter_buckets   (collective, as colocated)
    trainer rank 0       pack each bucket on the host -> LoadWeights(version, layout, probe) to every engine
                         -> the sender thread broadcasts once the engines want it (transport.py)
    every trainer rank   the actor's probe log-probs of this version, kept until the engines answer
    engine e             receive, load, compute the probe's log-probs -> Loaded(version, log-probs)
    verify               rank 0 compares each engine's log-probs with the actor's of that version, every rank
                         raises WeightSyncError above sync.probe_tolerance

The push returns once the weights are staged: with ``rollout.max_staleness`` > 0 the engines may still be
generating older batches, and load the version when they reach its LoadWeights. A version is verified when
its Loaded replies arrive, which is before any sample of that version reaches the trainer (an engine
answers in order). With ``wait=True`` (k = 0, the last step) the push waits for the verification, as the
colocated sync does.
"""

from __future__ import annotations

import math
import time

import torch

from pacs_megatron.rollout.remote import RemoteEngines, broadcast_from_rank0
from pacs_megatron.weight_sync.buckets import iter_buckets
from pacs_megatron.weight_sync.sync import SyncResult, WeightSync
from pacs_megatron.weight_sync.transport import WeightGroup, WeightSender, pack


class RemoteWeightSync(WeightSync):
    """:class:`~pacs_megatron.weight_sync.sync.WeightSync` through the weight group of ``engines``."""

    def __init__(self, actor, engines: RemoteEngines, cfg, vocab_size: int, param_dtype, rollout, device) -> None:
        """Collective: trainer rank 0 joins the weight group (the engines join it once built)."""
        super().__init__(actor, engines, cfg, vocab_size, param_dtype, rollout)
        self.engines = engines
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """version -> (actor, reference) probe log-probs, until every engine's Loaded was compared."""
        self._answers: dict[int, int] = {}
        self.sender = None
        self.device = torch.device(device)
        if engines.rank == 0:
            group = WeightGroup(engines.backend, engines.store, 0, 1 + engines.count, device, engines.timeout_s)
            self.sender = WeightSender(group, engines.wait_wanted)

    def push_version(self, version: int) -> SyncResult:
        """Stage the actor's weights as ``version`` and queue them for the engines (collective; no waiting)."""
        start = time.perf_counter()
        layout, buffers, total, count = [], [], 0, 0
        pin = self.device.type == "cuda"
        for bucket in iter_buckets(self._stream(), self.bucket_bytes, self.send_dtype):
            total += sum(t.numel() * t.element_size() for _, t in bucket)
            count += 1
            if self.sender is not None:
                entry, buf = pack(bucket, pin=pin)
                layout.append(entry)
                buffers.append(buf)
        probe = self.probe_sequences() if self.probe is not None else []
        if self.sender is not None:
            self.engines.send_load(version, layout, probe)
            self.sender.send(version, buffers)
        if self.probe is not None:
            self.pending[version] = self.reference_logprobs()
        return SyncResult(time.perf_counter() - start, total / 1e9, float("nan"), count)

    def verify(self, upto: int) -> tuple[float, float]:
        """Collective: compare the probes the engines returned for every version <= ``upto`` (waiting for all of
        ``upto``'s, when still pending) with the actor's; raise WeightSyncError above the tolerance. Returns
        ``(max diff, max quantization gap)``, nan when nothing was compared."""
        payload = None
        if self.sender is not None:
            needed = self.engines.count - self._answers.get(upto, 0) if upto in self.pending else 0
            nan3 = (math.nan, math.nan, math.nan)
            payload = [
                (
                    m.version,
                    m.engine,
                    *(self.compare(m.probe_logprobs, *self.pending[m.version]) if m.version in self.pending else nan3),
                )
                for m in self.engines.take_loaded(upto, needed)
            ]
        rows = broadcast_from_rank0(payload)
        for version, *_ in rows:
            self._answers[version] = self._answers.get(version, 0) + 1
            if self._answers[version] == self.engines.count:
                self.pending.pop(version, None)
                del self._answers[version]
        compared = [r for r in rows if not math.isnan(r[3])]
        if not compared:
            return math.nan, math.nan
        worst = max(compared, key=lambda r: r[3])
        self.raise_if_off(worst[2], worst[3])
        return worst[2], max(r[4] for r in compared)

    def sync(self, version: int = 0, wait: bool = True) -> SyncResult:
        """Push ``version``; with ``wait`` wait for every engine's probe of it and verify (raises above the
        tolerance), as the colocated sync does; without, ``max_logprob_diff`` is nan (verified later, when the
        first samples of ``version`` are taken)."""
        pushed = self.push_version(version)
        diff, gap = self.verify(version) if wait else (math.nan, math.nan)
        return SyncResult(pushed.seconds, pushed.gbytes, diff, pushed.buckets, gap)
