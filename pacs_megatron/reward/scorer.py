"""Batch reward scoring that never crashes or hangs the trainer.

math-verify times its parsers out with ``signal.alarm``, which only works in a process's main thread,
and a pathological answer can still make sympy run for minutes. So rewards run in worker processes,
one response at a time, each with a hard deadline:

    parent: pending responses -> idle ready worker (pipe) -> result | deadline passed | worker died
    worker: load reward.fn once -> "ready" -> loop: (i, prompt, response, answer, extra) -> (i, status, value)

- A response that raises scores 0 and counts in ``reward/errors`` (the first few are logged).
- A response still running ``timeout_s`` after it was handed over scores 0 and counts in
  ``reward/timeouts``; its worker is killed (SIGKILL) and replaced, so a hung worker costs one
  timeout, never the run. A worker that dies mid-task counts as an error and is replaced.
- A reward that returns a non-number, or that cannot be loaded in a worker, raises
  :class:`~pacs_megatron.reward.registry.RewardFunctionError`: those are bugs, not noisy samples.

Workers are fresh interpreters (``python -m pacs_megatron.reward.worker``, see that module for the
protocol): never ``fork`` (the trainer holds torch threads and gloo groups), and not multiprocessing's
spawn either, which re-imports the parent's ``__main__``. A worker is only handed work once it
reported ready, so its start-up (imports) never counts against a response's deadline.

``num_workers=0`` scores in the calling process (cheap rewards such as ``arith``); exceptions are still
counted, but there is no timeout there.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from pacs_megatron.reward.registry import RewardFunctionError, check_score, load_reward_fn
from pacs_megatron.utils.logging import get_logger

if TYPE_CHECKING:  # the config imports torch, which this module does not need
    from pacs_megatron.config import RewardConfig

logger = get_logger(__name__)

_STARTUP_TIMEOUT_S = 120.0
_MAX_LOGGED_ERRORS = 3


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    started: float
    ready: bool = False
    task: tuple[int, float] | None = None  # (response index, time it was handed over)


class RewardScorer:
    """Scores batches of responses with ``cfg.fn`` in ``cfg.num_workers`` processes.

    Example:
        >>> from pacs_megatron.config import RewardConfig
        >>> with RewardScorer(RewardConfig(fn="arith", num_workers=0)) as scorer:
        ...     scorer.score(["1+2="] * 2, ["3", "4"], ["3", "3"])
        ([1.0, 0.0], {'reward/timeouts': 0.0, 'reward/errors': 0.0, 'reward/worker_restarts': 0.0})
    """

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.fn = load_reward_fn(cfg.fn)  # fail fast, in the parent, with the loader's message
        self._workers: list[_Worker] = []
        self._remote = None  # reward.backend=ray: the actor pool, built on first use

    # -- public API -------------------------------------------------------------------------

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
        items = list(zip(prompts, responses, ground_truths, extras))
        if self.cfg.backend != "local":
            self._remote = self._remote or remote_pool(self.cfg)
            return self._remote.score(items)
        if self.cfg.num_workers == 0:
            return self._score_inline(items)
        return self._score_pool(items)

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
        if getattr(self, "_remote", None) is not None:
            self._remote.close()
            self._remote = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- in-process ---------------------------------------------------------------------------

    def _score_inline(self, items: list[tuple]) -> tuple[list[float], dict[str, float]]:
        scores, errors = [], 0
        for prompt, response, answer, extra in items:
            try:
                value = self.fn(prompt, response, answer, extra)
            except Exception as e:  # noqa: BLE001 - a failing sample scores 0 and is counted
                errors += 1
                if errors <= _MAX_LOGGED_ERRORS:
                    logger.warning("reward %s raised %s: %s (scored 0)", self.cfg.fn, type(e).__name__, e)
                scores.append(0.0)
                continue
            scores.append(check_score(self.cfg.fn, value))
        return scores, _metrics(0, errors, 0)

    # -- process pool -------------------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = Pipe(duplex=True)  # a socketpair; the child inherits its end's fd
        fd = child_conn.fileno()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pacs_megatron.reward.worker", str(fd)], pass_fds=(fd,), stdin=subprocess.DEVNULL
        )
        child_conn.close()
        parent_conn.send(("init", self.cfg.fn, list(sys.path)))
        return _Worker(proc=proc, conn=parent_conn, started=time.monotonic())

    def _replace(self, k: int) -> None:
        _stop(self._workers[k], grace_s=0.0)
        self._workers[k] = self._start_worker()

    def _score_pool(self, items: list[tuple]) -> tuple[list[float], dict[str, float]]:
        while len(self._workers) < self.cfg.num_workers:
            self._workers.append(self._start_worker())
        timeout = self.cfg.timeout_s
        scores = [0.0] * len(items)
        pending = deque(range(len(items)))
        timeouts = errors = restarts = 0
        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                if w.ready and w.task is None and pending:
                    i = pending.popleft()
                    try:
                        w.conn.send((i, *items[i]))
                    except (OSError, ValueError):  # died while idle: retry the item elsewhere
                        pending.appendleft(i)
                        self._replace(k)
                        restarts += 1
                        continue
                    w.task = (i, now)
            deadlines = [w.task[1] + timeout for w in self._workers if w.task is not None]
            deadlines += [w.started + _STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
            until = min(deadlines, default=now + 1.0)
            wait([w.conn for w in self._workers], timeout=max(0.0, until - time.monotonic()))
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                status = self._poll(w, scores, log=errors < _MAX_LOGGED_ERRORS)
                if status == "error":
                    errors += 1
                elif status == "dead":
                    if w.task is not None:
                        errors += 1
                        logger.warning("reward worker died while scoring response %d (scored 0)", w.task[0])
                    elif not w.ready:
                        self.close()
                        raise RuntimeError(f"reward worker for reward.fn={self.cfg.fn!r} died while starting")
                    self._replace(k)
                    restarts += 1
                elif w.task is not None and now - w.task[1] > timeout:
                    timeouts += 1
                    logger.warning(
                        "reward %s took over reward.timeout_s=%gs on response %d: scored 0, worker replaced",
                        self.cfg.fn,
                        timeout,
                        w.task[0],
                    )
                    self._replace(k)
                    restarts += 1
                elif not w.ready and now - w.started > _STARTUP_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(f"reward worker for reward.fn={self.cfg.fn!r} did not start in time")
        return scores, _metrics(timeouts, errors, restarts)

    def _poll(self, w: _Worker, scores: list[float], log: bool) -> str | None:
        """Take one message from ``w`` if any: None (nothing / ready / a score), "error" or "dead"."""
        try:
            if not w.conn.poll():
                return "dead" if w.proc.poll() is not None and not w.conn.poll() else None
            msg = w.conn.recv()
        except (EOFError, OSError):
            return "dead"
        tag = msg[0]
        if tag == "ready":
            w.ready = True
            return None
        if tag == "fatal":
            self.close()
            raise RewardFunctionError(f"reward.fn={self.cfg.fn!r} failed to load in a worker: {msg[1]}")
        i, status, value = msg
        w.task = None
        if status == "ok":
            scores[i] = check_score(self.cfg.fn, value)
            return None
        if status == "bad_type":
            self.close()
            raise RewardFunctionError(
                f"reward.fn={self.cfg.fn!r} returned {value}: it must return a float (e.g. 1.0 or 0.0)"
            )
        if log:
            logger.warning("reward %s raised on response %d: %s (scored 0)", self.cfg.fn, i, value)
        return "error"


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


def remote_pool(cfg: RewardConfig):
    """The scorer pool of a non-local ``reward.backend`` (imports ray only when asked for)."""
    from pacs_megatron.reward.ray_backend import RayRewardPool

    return RayRewardPool(cfg)


def _metrics(timeouts: int, errors: int, restarts: int) -> dict[str, float]:
    return {
        "reward/timeouts": float(timeouts),
        "reward/errors": float(errors),
        "reward/worker_restarts": float(restarts),
    }
