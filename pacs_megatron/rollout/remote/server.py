"""The engine side of ``rollout.placement=separate``: one engine process serves the trainer's commands in order.

    Generate(tag, prompts, sampling) -> engine.generate -> Result(tag, groups, version)
    LoadWeights(version, layout)     -> WeightsWanted -> receive the buckets (weight group) -> engine.update_weights
                                        -> bitwise check (sync.verify_bitwise: what arrived, cast to the
                                           engine's dtype, against what the engine holds; Report)
                                        -> probe log-probs and the greedy continuation of the probe's prompts
                                        -> Loaded(version, probe log-probs, continuation, report)
    Close / the trainer gone         -> return

Commands are served strictly in arrival order, one at a time: a Generate queued after a LoadWeights is
sampled with those weights, which is what bounds staleness (rollout/pipeline.py). Every sample of a Result
carries the version of the weights it was drawn with. The receiving side of the weight group is injected
(``receive``: weight_sync/remote.py), so this module knows engines and messages only.

A failure while serving is reported to the trainer as :class:`~pacs_megatron.rollout.remote.protocol.Failed` with
its traceback (the trainer raises it, naming the engine) before this process exits 1.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Iterable, Iterator

from pacs_megatron.rollout.base import PROBE_LEN, ChecksumReader, NamedTensors, RolloutEngine
from pacs_megatron.rollout.remote.protocol import (
    DELAY_ENV,
    Close,
    Failed,
    Generate,
    Loaded,
    LoadWeights,
    Result,
    WeightsWanted,
    recv,
    send,
)
from pacs_megatron.rollout.types import SamplingParams
from pacs_megatron.rollout.weight_checksum import Recorder, Report, compare
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

Receive = Callable[[LoadWeights], Iterable[NamedTensors]]
STALE_ENV = "PACS_ENGINE_STALE_TENSOR"
"""Test hook, "VERSION:NAME": at the load of that version the engine loads the HF tensor NAME wrong (what
arrived + 1, after fingerprinting it): a planted bad load, which the bitwise check must name."""


class EngineServer:
    """Serves one control connection with one engine.

    Example:
        >>> EngineServer(0, engine, conn, receive=lambda msg: []).serve()  # doctest: +SKIP
        0
    """

    def __init__(self, index: int, engine: RolloutEngine, conn, receive: Receive, verify: bool = False) -> None:
        """``verify``: ``sync.verify_bitwise``, check every load bit for bit (:meth:`_load`)."""
        self.index, self.engine, self.conn, self.receive = index, engine, conn, receive
        self.reader = engine if verify and isinstance(engine, ChecksumReader) else None
        """The engine as the bitwise check reads it back (None: the check is off, or the engine cannot be read)."""
        self.version = -1
        """Policy version of the weights the engine holds (-1: its start-up weights, never sampled with)."""
        delays = [float(x) for x in (os.environ.get(DELAY_ENV) or "0").split(",")]
        self.delay_s = delays[min(index, len(delays) - 1)]  # test hook: a slow engine
        self._busy = self._idle = 0.0
        version, _, name = (os.environ.get(STALE_ENV) or "-2:").partition(":")
        self.stale = (int(version), name)  # test hook

    def _times(self) -> dict:
        out = {"engine": self.index, "busy_s": self._busy, "idle_s": self._idle}
        self._busy = self._idle = 0.0
        return out

    def serve(self) -> int:
        """Serve until Close (0) or until the trainer is gone or a command failed (1)."""
        while True:
            t0 = time.perf_counter()
            try:
                msg = recv(self.conn)
            except (EOFError, OSError):
                logger.warning("engine %d: the trainer closed the connection; exiting", self.index)
                return 1
            self._idle += time.perf_counter() - t0
            if isinstance(msg, Close):
                return 0
            try:
                self._handle(msg)
            except Exception:  # noqa: BLE001 - the trainer reports it, naming this engine
                error = traceback.format_exc()
                logger.error("engine %d failed:\n%s", self.index, error)
                try:
                    send(self.conn, Failed(**self._times(), error=error))
                except OSError:
                    pass
                return 1

    def _handle(self, msg) -> None:
        if isinstance(msg, Generate):
            self._generate(msg)
        elif isinstance(msg, LoadWeights):
            self._load(msg)
        else:
            raise TypeError(f"engine {self.index}: unknown command {type(msg).__name__}")

    def _generate(self, msg: Generate) -> None:
        t0 = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        groups = self.engine.generate(msg.prompts, msg.sampling) if msg.prompts else []
        self._busy += time.perf_counter() - t0
        send(self.conn, Result(**self._times(), tag=msg.tag, groups=groups, version=self.version))

    def _load(self, msg: LoadWeights) -> None:
        send(self.conn, WeightsWanted(**self._times(), version=msg.version))
        t0 = time.perf_counter()
        buckets = self._waited(self.receive(msg))
        recorder = Recorder(self.engine.traits().weight_dtype, wire=True) if self.reader is not None else None
        buckets = recorder.buckets(buckets) if recorder else buckets
        planted = msg.version == self.stale[0]
        loaded = self.engine.update_weights(self._planted(buckets) if planted else buckets)
        load_s = time.perf_counter() - t0
        self.version = msg.version
        report = self._bitwise(recorder) if recorder else None
        probe = self.engine.logprobs(msg.probe) if msg.probe else []
        continuation = self._continue(msg.probe) if msg.probe else []
        self._busy += time.perf_counter() - t0
        logger.debug("engine %d: version %d loaded (%s tensors) in %.2fs", self.index, msg.version, loaded, load_s)
        reply = Loaded(
            **self._times(),
            version=msg.version,
            probe_logprobs=probe,
            load_s=load_s,
            probe_continuation=continuation,
            bitwise=report,
        )
        send(self.conn, reply)

    def _continue(self, probe: list[list[int]]) -> list[list[int]]:
        """The greedy continuation of each probe row's prompt (its first PROBE_LEN // 2 tokens), for the next probe."""
        half = PROBE_LEN // 2
        greedy = SamplingParams(n=1, temperature=1.0, top_k=1, max_tokens=PROBE_LEN - half, seed=0)
        return [list(g[0].token_ids) for g in self.engine.generate([row[:half] for row in probe], greedy)]

    def _bitwise(self, recorder: Recorder) -> Report | None:
        """The load checked here (held vs received, in the engine's dtype); the trainer checks the transport
        (received vs sent, as sent) with :attr:`Report.received`. None when the engine cannot be read back."""
        start = time.perf_counter()
        held = self.reader.weight_checksums() if self.reader is not None else None
        if held is None:
            return None
        differs, unverified = compare(recorder.sums, held)
        return Report(recorder.wire_sums, differs, unverified, recorder.seconds + time.perf_counter() - start)

    def _planted(self, buckets: Iterable[NamedTensors]) -> Iterator[NamedTensors]:
        """The test hook of :data:`STALE_ENV`."""
        for bucket in buckets:
            yield [(n, t + 1 if n == self.stale[1] else t) for n, t in bucket]

    def _waited(self, buckets: Iterable[NamedTensors]) -> Iterator[NamedTensors]:
        """``buckets``, with the wait for the first one (the trainer's sender starting) counted as idle."""
        t0 = time.perf_counter()
        first = True
        for bucket in buckets:
            if first:
                self._idle += time.perf_counter() - t0
                self._busy -= time.perf_counter() - t0  # counted once, as idle (load_s still includes it)
                first = False
            yield bucket
