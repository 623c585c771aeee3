"""The engines of ``rollout.placement=separate`` as the trainer ranks see them.

:class:`RemoteEngines` is the trainer's engine when the engines run in their own processes
(rollout/remote/server.py, started by the launcher): trainer rank 0 holds one control connection per engine
(rollout/remote/protocol.py) and a reader thread per connection; the other trainer ranks never talk to an engine.
Calls that return samples are collective over the trainer ranks: rank 0 waits for the engines and
broadcasts the result (or the failure) over the trainer's default group.

Sharding matches the colocated engines exactly: prompts are cut into contiguous shares, one per engine, and
engine e samples with seed ``step_seed(seed, step, e)``, as colocated replica e does (rollout/collect.py).
With as many engines as colocated replicas the samples are the same, bit for bit, given the same weights.

``submit`` returns at once; ``collect`` waits. Between them the engines work while the trainer trains:
that is the whole of the asynchrony (rollout/pipeline.py decides what to submit when).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from pacs_megatron.config import RolloutConfig
from pacs_megatron.rollout.base import EngineTraits
from pacs_megatron.rollout.collect import step_seed
from pacs_megatron.rollout.remote.protocol import (
    Close,
    Failed,
    Generate,
    Init,
    Loaded,
    LoadWeights,
    Ready,
    Reply,
    Result,
    WeightsWanted,
    connect_store,
    publish_auth,
    recv,
    send,
    trainer_connect,
)
from pacs_megatron.rollout.types import Response, SamplingParams
from pacs_megatron.utils.dist import rank_and_world, shard_bounds
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class EngineFailure(RuntimeError):
    """An engine process failed or vanished; the message names it and its error."""


def broadcast_from_rank0(obj):
    """``obj`` of trainer rank 0 on every trainer rank (the default group)."""
    import torch.distributed as dist

    if rank_and_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Inbox:
    """Rank 0: the engines' replies, filed by the reader threads, waited for by the loop and the sender."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.cond = threading.Condition()
        self.results: dict = defaultdict(dict)  # tag -> engine -> Result
        self.ready: dict[int, Ready] = {}
        self.wanted: dict[int, set[int]] = defaultdict(set)  # version -> engines waiting for it
        self.loaded: list[Loaded] = []
        self.busy = [0.0] * count
        self.idle = [0.0] * count
        self.failure: str | None = None

    def put(self, msg: Reply) -> None:
        with self.cond:
            self.busy[msg.engine] += msg.busy_s
            self.idle[msg.engine] += msg.idle_s
            if isinstance(msg, Result):
                self.results[msg.tag][msg.engine] = msg
            elif isinstance(msg, Ready):
                self.ready[msg.engine] = msg
            elif isinstance(msg, WeightsWanted):
                self.wanted[msg.version].add(msg.engine)
            elif isinstance(msg, Loaded):
                self.loaded.append(msg)
            elif isinstance(msg, Failed):
                last = [x for x in msg.error.strip().splitlines() if x.strip()][-1:] or ["(no message)"]
                self.failure = self.failure or f"rollout engine {msg.engine} failed: {last[0]}"
            self.cond.notify_all()

    def fail(self, text: str) -> None:
        with self.cond:
            self.failure = self.failure or text
            self.cond.notify_all()

    def wait(self, done: Callable[[], object], timeout_s: float | None = None, what: str = "the engines"):
        """Block until ``done()`` is truthy (called under the lock) and return it; raise on an engine failure."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            while True:
                if self.failure:
                    raise EngineFailure(self.failure)
                out = done()
                if out:
                    return out
                if deadline is not None and time.monotonic() > deadline:
                    raise EngineFailure(f"waited {timeout_s:g}s for {what} (rollout.engine_timeout_s)")
                self.cond.wait(1.0)


class RemoteEngines:
    """A :class:`~pacs_megatron.rollout.base.Generator` whose replicas are engine processes (collective); the
    weights reach them through weight_sync/remote.py's group, not through this object; its
    :meth:`generate_step` shards a step among the engines."""

    def __init__(
        self, rollout: RolloutConfig, model_dir, tokenizer_dir, config_dict: dict, device: torch.device
    ) -> None:
        """Collective: rank 0 connects to the ``rollout.engines`` engines, sends them the config (``config_dict``,
        the whole run's as plain data: the engine processes build from it) and waits until each has built its
        engine (``rollout.engine_timeout_s``)."""
        self.rank, _ = rank_and_world()
        # FP8 rollouts on vLLM: the engines are built for FP8 data + scales (launch/engine_rank.py,
        # weight_sync/quantize.py ``vllm_fp8_config``), so the sync sends them as they are (GPU only, never run)
        self._traits = EngineTraits(fp8_weights=rollout.engine == "vllm" and rollout.quantization == "fp8")
        self.count = rollout.engines
        self.timeout_s = rollout.engine_timeout_s
        self.backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        self.store = None
        self.conns: list = []
        self.inbox = Inbox(self.count)
        self._tags = itertools.count()
        self._closing = False
        problem = None
        if self.rank == 0:
            try:
                self._connect(Init(config_dict, str(model_dir), str(tokenizer_dir), self.backend, self.count))
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                problem = f"{type(e).__name__}: {e}"
        problem = broadcast_from_rank0(problem)
        if problem:
            raise EngineFailure(f"rollout.placement=separate: the engines did not start: {problem}")

    def _connect(self, init: Init) -> None:
        self.store = connect_store(self.timeout_s)
        key = publish_auth(self.store)
        for e in range(self.count):
            self.conns.append(trainer_connect(self.store, key, e, self.timeout_s))
        for e, conn in enumerate(self.conns):
            send(conn, init)
            threading.Thread(target=self._read, args=(e, conn), daemon=True, name=f"engine{e}-reader").start()
        self.inbox.wait(lambda: len(self.inbox.ready) == self.count, self.timeout_s, "the engines to build")
        logger.info("%d rollout engine(s) ready on their own processes (%s)", self.count, self.backend)

    def _read(self, e: int, conn) -> None:
        while True:
            try:
                msg = recv(conn)
            except (EOFError, OSError):
                if not self._closing:
                    self.inbox.fail(f"rollout engine {e}: connection lost (the engine process died; see its log)")
                return
            except Exception as err:  # noqa: BLE001 - a message that does not unpickle: fail the waiters
                self.inbox.fail(f"rollout engine {e}: unreadable reply ({type(err).__name__}: {err})")
                return
            self.inbox.put(msg)

    def traits(self) -> EngineTraits:
        """One replica that every trainer rank sees whole; the weights travel through the weight group."""
        return self._traits

    # -- samples -----------------------------------------------------------------------------------

    def submit(self, tag, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, step: int) -> None:
        """Queue a generation on every engine (rank 0; returns at once): engine e gets the e-th contiguous share
        of the prompts and seed ``step_seed(sampling.seed, step, e)``."""
        if self.rank != 0:
            return
        for e, conn in enumerate(self.conns):
            lo, hi = shard_bounds(len(prompt_ids), e, self.count)
            seeded = replace(sampling, seed=step_seed(sampling.seed or 0, step, e))
            send(conn, Generate(tag, [list(p) for p in prompt_ids[lo:hi]], seeded))

    def collect(self, tag) -> tuple[list[list[Response]], list[int], float, tuple[list[float], list[float]]]:
        """Collective: ``(groups in prompt order, policy version of each group, seconds rank 0 waited, each
        engine's (busy, idle) seconds reported since the last collect)``.

        MoE routing records (``Response.routed_experts``) stay on rank 0, which received them: the other
        ranks get the responses without them, as a colocated replica's ranks get other replicas'
        (rollout/collect.py). ``prepare_local_batch`` then moves each record from rank 0 to the one rank
        that trains its row (data/routing.py); broadcasting them would put the whole step's records
        (~10 GB at the Qwen3-30B-A3B recipe) on every rank."""
        payload: Any = None
        own = None
        if self.rank == 0:
            t0 = time.perf_counter()
            try:
                got = self.inbox.wait(lambda: len(self.inbox.results[tag]) == self.count and self.inbox.results[tag])
                with self.inbox.cond:
                    del self.inbox.results[tag]
                results = [got[e] for e in range(self.count)]
                groups = [g for r in results for g in r.groups]
                versions = [r.version for r in results for _ in r.groups]
                own = groups
                if any(r.routed_experts is not None for g in groups for r in g):
                    groups = [[replace(r, routed_experts=None) for r in g] for g in groups]
                payload = (groups, versions, time.perf_counter() - t0, self.take_times())
            except EngineFailure as e:
                payload = str(e)
        payload = broadcast_from_rank0(payload)
        if isinstance(payload, str):
            raise EngineFailure(payload)
        groups, versions, waited, times = payload
        return (groups if own is None else own), versions, waited, times

    def generate_step(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, step: int
    ) -> list[list[Response]]:
        """Collective: ``sampling.n`` responses per prompt, sampled now (queued behind earlier commands); engine
        e samples its share as colocated replica e would (:meth:`submit`)."""
        tag = ("call", next(self._tags))
        self.submit(tag, prompt_ids, sampling, step)
        return self.collect(tag)[0]

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[list[Response]]:
        """Collective (every trainer rank calls it with the same arguments)."""
        return self.generate_step(prompt_token_ids, sampling, 0)

    # -- weights (the data plane is weight_sync/remote.py's) --------------------------------------------

    def send_load(self, version: int, layout: list, probe: list[list[int]]) -> None:
        """Rank 0: queue a LoadWeights behind the commands already sent to every engine."""
        for conn in self.conns:
            send(conn, LoadWeights(version, layout, probe))

    def wait_wanted(self, version: int) -> None:
        """Until every engine reached the LoadWeights of ``version`` (called by the weight sender's thread)."""
        self.inbox.wait(lambda: len(self.inbox.wanted[version]) == self.count)
        with self.inbox.cond:
            del self.inbox.wanted[version]

    def take_loaded(self, upto: int, needed: int = 0) -> list[Loaded]:
        """Rank 0: the Loaded replies of versions <= ``upto``, once ``needed`` of them are ``upto``'s."""
        self.inbox.wait(lambda: sum(m.version == upto for m in self.inbox.loaded) >= needed or not needed)
        with self.inbox.cond:
            out = [m for m in self.inbox.loaded if m.version <= upto]
            self.inbox.loaded = [m for m in self.inbox.loaded if m.version > upto]
        return out

    def take_times(self) -> tuple[list[float], list[float]]:
        """Rank 0: each engine's (busy, idle) seconds reported since the last call."""
        with self.inbox.cond:
            out = (self.inbox.busy, self.inbox.idle)
            self.inbox.busy, self.inbox.idle = [0.0] * self.count, [0.0] * self.count
        return out

    def sleep(self) -> None:
        """Nothing to free: the engines do not share the trainer's devices."""

    def wake(self) -> None:
        """See :meth:`sleep`."""

    def close(self) -> None:
        """Rank 0: tell every engine to exit once done with its queue (idempotent)."""
        self._closing = True
        for conn in self.conns:
            try:
                send(conn, Close())
                conn.close()
            except OSError:
                pass
        self.conns = []
