"""Batch reward scoring that never crashes or hangs the trainer, in every mode.

Rewards always run in worker processes, each response with a hard deadline (math-verify's ``signal.alarm``
needs a main thread, and a reward may hang or raise on anything):

    RewardScorer.score(prompts, responses, answers, extras)
        -> backend.score(items, counts)   # how: a local process pool (here) or another backend
        -> counts: BatchCounts            # what happened: shared accounting (accounting.py)

A response that raises, returns NaN/inf or runs past ``timeout_s`` scores 0 and is counted; a hung worker is
killed and replaced. ``num_workers=0`` means one worker: there is no unprotected in-process mode.
Each case, the chunked protocol and why workers are fresh interpreters: docs/rewards.md.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Protocol

from pacs_megatron.reward.accounting import STARTUP_TIMEOUT_S as _STARTUP_TIMEOUT_S
from pacs_megatron.reward.accounting import BatchCounts, FailureGuard
from pacs_megatron.reward.registry import RewardFunctionError, load_reward_fn
from pacs_megatron.utils.logging import get_logger

if TYPE_CHECKING:
    from pacs_megatron.config import RewardConfig

logger = get_logger(__name__)

_MAX_CHUNK = 256
"""Most responses handed to a worker at once (smaller chunks balance several workers better)."""


class ScoringBackend(Protocol):
    """How responses get scored. ``score`` fills ``counts`` (see accounting.py) and returns one score
    per item, 0.0 for every item it could not score."""

    def score(self, items: list[tuple], counts: BatchCounts) -> list[float]: ...

    def close(self) -> None: ...


def make_backend(cfg: RewardConfig) -> ScoringBackend:
    """The backend ``cfg`` asks for: the local process pool, or Ray actors (ray imported only then)."""
    if cfg.backend == "ray":
        from pacs_megatron.reward.ray_backend import RayRewardPool

        return RayRewardPool(cfg)
    return ProcessPool(cfg)


class RewardScorer:
    """Scores batches of responses with ``cfg.fn``, each response under ``cfg.timeout_s``.

    Example:
        >>> from pacs_megatron.config import RewardConfig
        >>> with RewardScorer(RewardConfig(fn="arith", num_workers=0)) as scorer:
        ...     scorer.score(["1+2="] * 2, ["3", "4"], ["3", "3"])
        ([1.0, 0.0], {'reward/timeouts': 0.0, 'reward/errors': 0.0, 'reward/worker_restarts': 0.0})
    """

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.fn = load_reward_fn(cfg.fn)  # fail fast, in the parent, with the loader's message
        self.guard = FailureGuard(cfg.fn, cfg.max_failure_steps)
        """Consecutive all-failed steps (updated by score_rollouts with the counts of all ranks)."""
        self.last_error = ""
        """The last batch's last failure message ("" when it had none)."""
        self._backend = make_backend(cfg)

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[str],
        extras: Sequence[Any] | None = None,
    ) -> tuple[list[float], dict[str, float]]:
        """One score per response (0.0 on timeout or error) and the batch's counters.

        All sequences have one entry per response; ``extras`` holds each record's metadata (or None).
        """
        n = len(responses)
        extras = [None] * n if extras is None else list(extras)
        for name, seq in (("prompts", prompts), ("ground_truths", ground_truths), ("extras", extras)):
            if len(seq) != n:
                raise ValueError(f"RewardScorer.score: {name} has {len(seq)} entries for {n} responses")
        counts = BatchCounts(self.cfg.fn, self.cfg.timeout_s)
        items = list(zip(prompts, responses, ground_truths, extras))
        scores = self._backend.score(items, counts) if items else []
        self.last_error = counts.last_error
        return scores, counts.metrics()

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    started: float
    ready: bool = False
    queue: deque = field(default_factory=deque)
    """Indices handed over and not answered yet, in the order the worker scores them."""
    since: float = 0.0
    """When the head of ``queue`` started: its hand-over, or the answer before it."""


class ProcessPool:
    """``max(1, num_workers)`` local worker processes; chunks of responses out, their answers back."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.size = max(1, cfg.num_workers)
        self._workers: list[_Worker] = [self._start_worker() for _ in range(self.size)]

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for w in self._workers:  # ask all first, so they exit in parallel
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            _stop(w, grace_s=2.0)
        self._workers = []

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = Pipe(duplex=True)  # a socketpair; the child inherits its end's fd
        fd = child_conn.fileno()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pacs_megatron.reward.worker", str(fd)], pass_fds=(fd,), stdin=subprocess.DEVNULL
        )
        child_conn.close()
        parent_conn.send(("init", self.cfg.fn, list(sys.path)))
        return _Worker(proc=proc, conn=parent_conn, started=time.monotonic())

    def _replace(self, k: int, counts: BatchCounts) -> None:
        _stop(self._workers[k], grace_s=0.0)
        self._workers[k] = self._start_worker()
        counts.restart()

    def score(self, items: list[tuple], counts: BatchCounts) -> list[float]:
        # Imported here: this package is imported by every worker, which must not pay for torch.
        from pacs_megatron.utils.preemption import stop_requested

        if not self._workers:
            self._workers = [self._start_worker() for _ in range(self.size)]
        timeout = self.cfg.timeout_s
        scores = [0.0] * len(items)
        pending = deque(range(len(items)))
        chunk = max(1, min(_MAX_CHUNK, math.ceil(len(items) / (4 * self.size))))
        stop_by = None
        # The batch starts when every worker is ready (one replaced after the last batch's timeout may still
        # be importing): then the workers' first responses start, and a hanging reward times out, together.
        started = False
        while pending or any(w.queue for w in self._workers):
            now = time.monotonic()
            if stop_by is None and stop_requested():
                stop_by = now + timeout  # let a healthy batch finish; abandon a hung one
            if stop_by is not None and now >= stop_by:
                self._abandon(pending, counts)
                return scores
            started = started or all(w.ready for w in self._workers)
            for k, w in enumerate(self._workers):
                if started and w.ready and not w.queue and pending:
                    part = [pending.popleft() for _ in range(min(chunk, len(pending)))]
                    try:
                        w.conn.send(("score", [(i, *items[i]) for i in part]))
                    except (OSError, ValueError):  # died while idle: retry the items elsewhere
                        pending.extendleft(reversed(part))
                        self._replace(k, counts)
                        continue
                    w.queue.extend(part)
                    w.since = now
            deadlines = [w.since + timeout for w in self._workers if w.queue]
            deadlines += [w.started + _STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
            deadlines += [stop_by if stop_by is not None else now + 1.0]  # poll the stop flag every second
            wait([w.conn for w in self._workers], timeout=max(0.0, min(deadlines) - time.monotonic()))
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                alive = self._drain(w, scores, counts, now)
                if not alive:
                    if w.queue:
                        counts.error(w.queue.popleft(), f"reward worker died (exit code {w.proc.poll()})")
                    elif not w.ready:
                        self.close()
                        raise RuntimeError(f"reward worker for reward.fn={self.cfg.fn!r} died while starting")
                    pending.extendleft(reversed(w.queue))
                    self._replace(k, counts)
                elif w.queue and now - w.since > timeout:
                    counts.timeout(w.queue.popleft())
                    pending.extendleft(reversed(w.queue))
                    self._replace(k, counts)
                elif not w.ready and now - w.started > _STARTUP_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(f"reward worker for reward.fn={self.cfg.fn!r} did not start in time")
            if counts.hung() and (pending or any(w.queue for w in self._workers)):
                self._give_up(pending, counts)
                return scores
        return scores

    def _give_up(self, pending: deque, counts: BatchCounts) -> None:
        """The reward hangs (accounting.py): replace the busy workers; every unscored response is a timeout."""
        unscored = len(pending) + sum(len(w.queue) for w in self._workers)
        pending.clear()
        for k, w in enumerate(self._workers):
            if w.queue:
                w.queue.clear()
                self._replace(k, counts)
        counts.give_up(unscored)

    def _abandon(self, pending: deque, counts: BatchCounts) -> None:
        """A stop signal outlasted the batch: kill the busy workers; everything unscored is counted."""
        unscored = len(pending) + sum(len(w.queue) for w in self._workers)
        for w in self._workers:
            w.queue.clear()
            _stop(w, grace_s=0.0)
        self._workers = []  # restarted by the next score(), if there is one
        counts.interrupt(unscored)
        logger.warning("stop signal: abandoned %d unscored responses of reward %s", unscored, self.cfg.fn)

    def _drain(self, w: _Worker, scores: list[float], counts: BatchCounts, now: float) -> bool:
        """Take every message ``w`` has sent; False when it is dead."""
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv(), scores, counts, now)
        except (EOFError, OSError):
            return False
        return w.proc.poll() is None

    def _handle(self, w: _Worker, msg: tuple, scores: list[float], counts: BatchCounts, now: float) -> None:
        tag = msg[0]
        if tag == "ready":
            w.ready = True
            return
        if tag == "fatal":
            self.close()
            raise RewardFunctionError(f"reward.fn={self.cfg.fn!r} failed to load in a worker: {msg[1]}")
        for i, status, value in msg[1]:
            if not w.queue or w.queue[0] != i:  # an answer for a response already given up on
                continue
            w.queue.popleft()
            w.since = now
            try:
                counts.answer(i, status, value, scores)
            except RewardFunctionError:
                self.close()
                raise


def _stop(w: _Worker, grace_s: float) -> None:
    """End a worker: give it ``grace_s`` to exit (after it was sent None), then SIGKILL; reap it."""
    if grace_s > 0:
        try:
            w.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    if w.proc.poll() is None:
        w.proc.kill()
    w.proc.wait()
    w.conn.close()
