"""What happened to a batch of rewards, and when failures stop the run: shared by every scoring backend.

A backend (the local process pool in :mod:`.scorer`, or any other behind its factory) only decides *how*
responses are scored; it reports *what* happened through one :class:`BatchCounts` per batch, so counters,
log lines and the last error mean the same for every backend. :class:`FailureGuard` stops the run with
:class:`RewardFailureError` after ``reward.max_failure_steps`` steps in which every response failed.
Two timeouts in a row with no answer between them mean the reward hangs (:meth:`BatchCounts.hung`): the
batch's unscored responses count as timeouts at once. The calls and why: docs/rewards.md, "Accounting".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

MAX_LOGGED = 3
"""Failures logged per batch; the rest are only counted."""

STARTUP_TIMEOUT_S = 120.0
"""Seconds a scoring worker (process or Ray actor) may take to import and load reward.fn."""


class RewardFailureError(RuntimeError):
    """Every response failed to score for ``reward.max_failure_steps`` consecutive steps."""


class RewardInterrupted(SystemExit):
    """A stop signal arrived while rewards were still (timing out) being scored: the step is not
    finished, so it is not checkpointed; the run exits as pre-empted."""

    def __init__(self, message: str) -> None:
        from pacs_megatron.utils.preemption import EXIT_PREEMPTED  # torch: not in the workers' imports

        super().__init__(EXIT_PREEMPTED)
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass
class BatchCounts:
    """Counters of one scored batch, and the last failure's message."""

    fn: str
    """reward.fn, for log lines."""
    timeout_s: float = 0.0
    """reward.timeout_s, for log lines."""
    timeouts: int = 0
    errors: int = 0
    restarts: int = 0
    interrupted: int = 0
    last_error: str = ""
    """The last failure's ``"Type: message"`` (or the timeout), named when failures stop the run."""
    timeouts_in_a_row: int = 0
    """Timeouts since the last answer (an answer resets it; two mean the reward hangs)."""

    def hung(self) -> bool:
        """True after two timeouts with no answer between them (see the module docstring)."""
        return self.timeouts_in_a_row >= 2

    def give_up(self, unscored: int) -> None:
        """The batch is hung: its ``unscored`` responses count as timeouts (scored 0), logged once."""
        self.timeouts += unscored
        self.last_error = f"hung: two responses in a row ran past reward.timeout_s={self.timeout_s:g}s"
        logger.warning(
            "reward %s hangs (two responses in a row ran past reward.timeout_s=%gs): the batch's %d unscored "
            "responses count as timed out (scored 0)",
            self.fn,
            self.timeout_s,
            unscored,
        )

    @property
    def failed(self) -> int:
        """Responses that scored 0 because they could not be scored."""
        return self.timeouts + self.errors + self.interrupted

    def error(self, i: int, message: str) -> None:
        self.timeouts_in_a_row = 0  # something came back
        self.errors += 1
        self.last_error = message
        if self.timeouts + self.errors <= MAX_LOGGED:
            logger.warning("reward %s failed on response %d: %s (scored 0)", self.fn, i, message)

    def timeout(self, i: int) -> None:
        self.timeouts += 1
        self.timeouts_in_a_row += 1
        self.last_error = f"timed out after reward.timeout_s={self.timeout_s:g}s"
        if self.timeouts + self.errors <= MAX_LOGGED:
            logger.warning(
                "reward %s took over reward.timeout_s=%gs on response %d: scored 0, worker replaced",
                self.fn,
                self.timeout_s,
                i,
            )

    def restart(self) -> None:
        self.restarts += 1

    def answer(self, i: int, status: str, value, scores: list[float]) -> None:
        """Record a worker's ``(status, value)`` for response ``i`` (the protocol of every backend):
        "ok" -> ``scores[i]``; "error", or a NaN / inf score -> counted, scored 0; "bad_type" ->
        RewardFunctionError (a bug in the reward: it returned a non-number), which the caller lets
        through after closing its workers.

        Example:
            >>> c, scores = BatchCounts("my:fn"), [0.0, 0.0]
            >>> c.answer(0, "ok", float("nan"), scores); c.answer(1, "ok", 1, scores)
            >>> scores, c.metrics()["reward/errors"], c.last_error
            ([0.0, 1.0], 1.0, 'returned nan: a reward must be finite')
        """
        from pacs_megatron.reward.registry import RewardFunctionError, check_score

        self.timeouts_in_a_row = 0
        if status == "ok":
            value = check_score(self.fn, value)
            if math.isfinite(value):
                scores[i] = value
            else:  # a reward error, not a bug of the trainer: counted (max_failure_steps covers it), scored 0
                self.error(i, f"returned {value}: a reward must be finite")
        elif status == "bad_type":
            raise RewardFunctionError(
                f"reward.fn={self.fn!r} returned {value}: it must return a float (e.g. 1.0 or 0.0)"
            )
        else:
            self.error(i, value)

    def interrupt(self, unscored: int) -> None:
        self.interrupted += unscored
        self.last_error = self.last_error or "interrupted by a stop signal"

    def metrics(self) -> dict[str, float]:
        out = {
            "reward/timeouts": float(self.timeouts),
            "reward/errors": float(self.errors),
            "reward/worker_restarts": float(self.restarts),
        }
        if self.interrupted:
            out["reward/interrupted"] = float(self.interrupted)
        return out


class FailureGuard:
    """Counts consecutive steps in which every response failed; raises at ``max_steps`` (0: never).

    Example:
        >>> g = FailureGuard("my:fn", max_steps=2)
        >>> g.update(total=4, failed=4, last_error="KeyError: 'x'")
        >>> g.update(total=4, failed=3, last_error="")  # one response scored: the count restarts
        >>> g.update(total=4, failed=4, last_error="KeyError: 'x'")
        >>> try:
        ...     g.update(total=4, failed=4, last_error="KeyError: 'x'")
        ... except RewardFailureError as e:
        ...     print(str(e)[:60], "...", str(e)[-25:])
        reward.fn='my:fn' failed on every response for 2 consecutive ... last error: KeyError: 'x'
    """

    def __init__(self, fn: str, max_steps: int) -> None:
        self.fn = fn
        self.max_steps = max_steps
        self.consecutive = 0

    def update(self, total: int, failed: int, last_error: str) -> None:
        if total == 0:
            return
        self.consecutive = self.consecutive + 1 if failed >= total else 0
        if self.consecutive:
            logger.warning(
                "reward %s failed on all %d responses of this step (%d/%s in a row): %s",
                self.fn,
                total,
                self.consecutive,
                self.max_steps or "inf",
                last_error,
            )
        if self.max_steps and self.consecutive >= self.max_steps:
            raise RewardFailureError(
                f"reward.fn={self.fn!r} failed on every response for {self.consecutive} consecutive steps "
                f"(reward.max_failure_steps={self.max_steps}); last error: {last_error}"
            )
