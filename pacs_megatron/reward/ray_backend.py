"""``reward.backend=ray``: score responses in Ray actors spread over the cluster's CPUs.

Same contract, accounting and metric names as the local process pool in :mod:`.scorer`, one response per
call to a plain Ray actor (its main thread, as math-verify's ``signal.alarm`` needs); an actor past the
deadline is killed and replaced. Joins ``$RAY_ADDRESS``, else starts a private Ray instance; ``ray`` is
imported only here. Details: docs/rewards.md, "reward.backend=ray".
"""

from __future__ import annotations

import numbers
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pacs_megatron.reward.accounting import STARTUP_TIMEOUT_S as _STARTUP_TIMEOUT_S
from pacs_megatron.reward.accounting import BatchCounts
from pacs_megatron.reward.registry import RewardFunctionError
from pacs_megatron.utils.logging import get_logger
from pacs_megatron.utils.proc import ray_job_runtime_env

if TYPE_CHECKING:
    from pacs_megatron.config import RewardConfig

logger = get_logger(__name__)


class RewardActor:
    """Holds one loaded reward function; created with ``ray.remote`` by :class:`RayRewardPool`."""

    def load(self, spec: str, sys_path: list[str]) -> str:
        """Load ``spec`` (raises to the pool if it cannot); return this actor's Ray node id."""
        import ray

        sys.path[:] = list(dict.fromkeys(sys_path + sys.path))  # user reward modules resolve as in the trainer
        from pacs_megatron.reward.registry import load_reward_fn

        self.fn = load_reward_fn(spec)
        if spec == "math":  # pay math-verify's cold start before taking work
            self.fn("", "\\boxed{1}", "1", None)
        return ray.get_runtime_context().get_node_id()

    def score(self, prompt: str, response: str, answer: str, extra: Any) -> tuple[str, Any]:
        try:
            value = self.fn(prompt, response, answer, extra)
        except Exception as e:  # noqa: BLE001 - a failing sample scores 0 and is counted
            return "error", f"{type(e).__name__}: {e}"
        if isinstance(value, numbers.Real):
            return "ok", float(value)
        return "bad_type", f"{type(value).__name__} {value!r:.80}"


@dataclass
class _Slot:
    actor: Any
    loading: Any  # ObjectRef of load(), None once ready
    started: float
    task: tuple[int, float, Any] | None = None  # (response index, time handed over, ObjectRef)
    node_id: str = ""


class RayRewardPool:
    """``cfg.num_workers`` reward actors on the Ray cluster; :meth:`score` mirrors the local pool."""

    def __init__(self, cfg: RewardConfig) -> None:
        import ray

        self.cfg = cfg
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=False)
        self._cls = ray.remote(
            num_cpus=1, max_restarts=0, scheduling_strategy="SPREAD", runtime_env=ray_job_runtime_env()
        )(RewardActor)
        self._slots: list[_Slot] = []

    def _start(self) -> _Slot:
        actor = self._cls.remote()
        return _Slot(actor, actor.load.remote(self.cfg.fn, list(sys.path)), time.monotonic())

    def _replace(self, k: int, counts: BatchCounts) -> None:
        import ray

        ray.kill(self._slots[k].actor, no_restart=True)
        self._slots[k] = self._start()
        counts.restart()

    def score(self, items: list[tuple], counts: BatchCounts) -> list[float]:
        import ray

        from pacs_megatron.utils.preemption import stop_requested

        while len(self._slots) < self.cfg.num_workers:
            self._slots.append(self._start())
        timeout = self.cfg.timeout_s
        scores = [0.0] * len(items)
        pending = deque(range(len(items)))
        stop_by = None
        while pending or any(s.task is not None for s in self._slots):
            now = time.monotonic()
            if stop_by is None and stop_requested():
                stop_by = now + timeout  # as the local pool: let a healthy batch finish, abandon a hung one
            if stop_by is not None and now >= stop_by:
                busy = [k for k, s in enumerate(self._slots) if s.task is not None]
                for k in busy:
                    self._slots[k].task = None
                    self._replace(k, counts)
                counts.interrupt(len(pending) + len(busy))
                return scores
            for s in self._slots:
                if s.loading is None and s.task is None and pending:
                    i = pending.popleft()
                    s.task = (i, now, s.actor.score.remote(*items[i]))
            refs = [s.task[2] for s in self._slots if s.task is not None]
            refs += [s.loading for s in self._slots if s.loading is not None]
            deadlines = [s.task[1] + timeout for s in self._slots if s.task is not None]
            deadlines += [s.started + _STARTUP_TIMEOUT_S for s in self._slots if s.loading is not None]
            deadlines += [stop_by if stop_by is not None else now + 1.0]  # poll the stop flag every second
            wait_s = max(0.0, min(deadlines) - time.monotonic())
            done = set(ray.wait(refs, num_returns=1, timeout=wait_s)[0]) if refs else set()
            now = time.monotonic()
            for k, s in enumerate(self._slots):
                if s.loading is not None:
                    if s.loading in done:
                        self._loaded(s)
                    elif now - s.started > _STARTUP_TIMEOUT_S:
                        self.close()
                        raise RuntimeError(f"reward actor for reward.fn={self.cfg.fn!r} did not start in time")
                    continue
                if s.task is None:
                    continue
                i, t0, ref = s.task
                if ref in done:
                    s.task = None
                    try:
                        status, value = ray.get(ref)
                    except ray.exceptions.RayActorError:
                        counts.error(i, "reward actor died")
                        self._replace(k, counts)
                        continue
                    try:
                        counts.answer(i, status, value, scores)
                    except RewardFunctionError:
                        self.close()
                        raise
                elif now - t0 > timeout:
                    s.task = None
                    counts.timeout(i)
                    self._replace(k, counts)
            busy = [k for k, s in enumerate(self._slots) if s.task is not None]
            if counts.hung() and (pending or busy):  # the reward hangs: one timeout per batch (accounting.py)
                for k in busy:
                    self._slots[k].task = None
                    self._replace(k, counts)
                counts.give_up(len(pending) + len(busy))
                return scores
        return scores

    def _loaded(self, s: _Slot) -> None:
        import ray

        try:
            s.node_id = ray.get(s.loading)
        except ray.exceptions.RayTaskError as e:  # the load raised in the actor: a config bug
            self.close()
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise RewardFunctionError(
                f"reward.fn={self.cfg.fn!r} failed to load in a Ray actor: {type(cause).__name__}: {cause}"
            ) from None
        except ray.exceptions.RayActorError:
            self.close()
            raise RuntimeError(f"reward actor for reward.fn={self.cfg.fn!r} died while starting") from None
        s.loading = None

    def close(self) -> None:
        """Kill the actors; leave Ray running unless this pool started it."""
        import ray

        if not ray.is_initialized():
            return
        for s in self._slots:
            ray.kill(s.actor, no_restart=True)
        self._slots = []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
