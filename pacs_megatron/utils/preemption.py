"""Graceful stop: on a signal or when the time budget runs out, checkpoint after the step and exit.

SIGTERM / SIGUSR1 exit with :data:`EXIT_PREEMPTED` (143, what requeue scripts test), SIGINT (Ctrl-C) with 130.
The handler only records the signal: between steps every rank agrees in :meth:`PreemptionFlag.should_stop`
(an all-reduce: one rank may see the signal alone), checkpoints and returns :attr:`PreemptionFlag.exit_code`.
A second SIGTERM or Ctrl-C means "now" (:func:`watch_second_signal`): a thread reading the wakeup fd kills the
descendants and ``os._exit``s, since a Python handler waits out a long native call. A signal within
:data:`DUPLICATE_S` of the first is the same request seen twice; SIGUSR1 is a warning, never "now".
The time budget (``trainer.stop_after_s``, ``trainer.deadline_unix``) stops when
``now + longest interval between checks + trainer.stop_margin_s`` would pass the end.
:attr:`PreemptionFlag.requeue` (a warning or the budget: continue later; any SIGTERM: the job ends) is agreed
by every rank and written by :meth:`PreemptionFlag.write_requeue_marker` for the batch script.

Who gets which signal, requeue and the early signals: docs/launch.md, "Pre-emption".
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import psutil

from pacs_megatron.utils.early_signals import early_signal, install_early_handlers  # noqa: F401 - re-exported
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

EXIT_PREEMPTED = 143  # 128 + SIGTERM: "terminated", what schedulers and requeue scripts expect
EXIT_INTERRUPTED = 130  # 128 + SIGINT: the shell's code for Ctrl-C
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
DUPLICATE_S = 1.0
NOT_SAVED = "the current step was not saved: --resume auto continues from the last checkpoint"
"""What a stop at once says about the run (utils/preemption.py and the launchers' parents)."""
REQUEUE_MARKER_ENV = "PACS_REQUEUE_MARKER"
"""The file the batch script asks rank 0 to write when the job should be requeued (step, reason)."""
_STOP_REQUESTED = threading.Event()
STOP_NOW = (signal.SIGTERM, signal.SIGINT)
"""The signals whose second arrival means "stop now" (SIGUSR1, a pre-emption warning, never does)."""
_WATCH: list[socket.socket] = []  # the current watcher's write end (closing it ends its thread)


class StopCounter:
    """Tells a second stop signal from the first, for a rank and for a launcher's parent alike.

    Example:
        >>> c = StopCounter()
        >>> c.second(signal.SIGTERM, now=10.0), c.second(signal.SIGTERM, now=10.5), c.second(signal.SIGINT, now=12.0)
        (False, False, True)
    """

    def __init__(self, first_at: float | None = None) -> None:
        self.first_at = first_at
        """monotonic time of the first SIGTERM / SIGINT (None: none yet)."""

    def second(self, signum: int, now: float | None = None) -> bool:
        """Record ``signum``; True when it is a second SIGTERM / SIGINT, more than DUPLICATE_S after the first."""
        if signum not in STOP_NOW:
            return False
        now = time.monotonic() if now is None else now
        if self.first_at is None:
            self.first_at = now
            return False
        return now - self.first_at > DUPLICATE_S


def exit_now_code(signum: int) -> int:
    """The exit code of a stop at once: the shell's 128 + signal, 130 for Ctrl-C, 143 for SIGTERM."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


def kill_descendants() -> int:
    """SIGKILL every descendant of this process (deepest first: none is left to re-parent); how many."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for child in reversed(children):
        try:
            child.kill()
        except psutil.Error:
            pass
    return len(children)


def exit_now(signum: int, what: str) -> None:
    """Log ``what`` (one line, with the signal and the code), kill every descendant, ``os._exit``."""
    code = exit_now_code(signum)
    logger.warning("second %s: exiting now with code %d; %s", signal.Signals(signum).name, code, what)
    for handler in logging.getLogger("pacs_megatron").handlers + logging.getLogger().handlers:
        handler.flush()
    kill_descendants()
    os._exit(code)


def watch_second_signal(counter: StopCounter, what: str, on_first: Callable[[int], None] | None = None) -> bool:
    """Main thread: from now on a second SIGTERM / Ctrl-C (``counter``) ends this process at once with
    :func:`exit_now`, from a helper thread that reads the signal numbers CPython writes to its wakeup fd
    (``signal.set_wakeup_fd``); ``on_first(signum)`` runs there on the first, so it is said at once too.
    The process must have Python handlers for SIGTERM and SIGINT (the wakeup fd sees only those). False
    (nothing installed) off the main thread. A later call replaces the watcher."""
    if threading.current_thread() is not threading.main_thread():
        return False
    read, write = socket.socketpair()
    write.setblocking(False)  # the C handler must never block on a full buffer
    signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
    for old in _WATCH:
        old.close()  # the previous watcher's recv sees EOF and its thread ends
    _WATCH[:] = [write]

    def watch() -> None:
        with read:
            while data := read.recv(64):
                for signum in data:
                    fresh = counter.first_at is None
                    if counter.second(signum):
                        exit_now(signum, what)
                    if fresh and counter.first_at is not None and on_first is not None:
                        on_first(signum)

    threading.Thread(target=watch, daemon=True, name="second-signal").start()
    return True


def stop_requested() -> bool:
    """Whether this process got a stop signal (for loops that must not wait out a hung step, e.g. rewards)."""
    return _STOP_REQUESTED.is_set()


def _terminate(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    raise SystemExit(EXIT_PREEMPTED)


def _stopping(signum: int) -> None:
    name = signal.Signals(signum).name
    logger.warning("received %s: stopping (a second SIGTERM or Ctrl-C ends it at once)", name)


def unwind_on_signals(what: str) -> bool:
    """For a command with no step to checkpoint (``eval``, ``compare``; main thread): SIGTERM unwinds it as
    Ctrl-C does (SystemExit(143) / KeyboardInterrupt, so its ``finally`` blocks stop what it started), and a
    second SIGTERM or Ctrl-C ends it at once, its descendants killed, ``what`` said
    (:func:`watch_second_signal`)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return watch_second_signal(StopCounter(), what, on_first=_stopping)


class PreemptionFlag:
    """Records stop requests; ``should_stop()`` is collective over the default group.

    ``trainer`` is a :class:`~pacs_megatron.config.TrainerConfig` (or anything with ``stop_after_s``,
    ``deadline_unix`` and ``stop_margin_s``); without it only signals stop the run.
    """

    def __init__(self, trainer=None) -> None:
        self.signum: int | None = early_signal()  # a signal during start-up counts
        if self.signum is not None:
            name = signal.Signals(self.signum).name
            logger.warning("received %s while starting up: will checkpoint after the first step and exit", name)
        self.exit_code = 0
        self.requeue = False
        """After a stop: whether the job should be continued (SIGUSR1 or the time budget, no SIGTERM)."""
        self.reason = ""
        self._budget_hit = False
        self._got_term = self.signum == signal.SIGTERM  # a later SIGTERM (scancel) overrides a warning
        self._started = self._last_check = time.monotonic()
        self._longest = 0.0
        end = float(getattr(trainer, "deadline_unix", 0.0) or 0.0)
        after = float(getattr(trainer, "stop_after_s", 0.0) or 0.0)
        # Everything in monotonic seconds; a deadline in Unix time is converted once, here.
        ends = ([end - time.time() + self._started] if end else []) + ([self._started + after] if after else [])
        self._end = min(ends) if ends else None
        self._margin = float(getattr(trainer, "stop_margin_s", 0.0) or 0.0)
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                signal.signal(s, self._handle)
            # a SIGTERM during start-up was the first: the next one is the second
            self.stops = StopCounter(self._started if self._got_term else None)
            watch_second_signal(self.stops, NOT_SAVED, on_first=self._announce)

    def _announce(self, signum: int) -> None:
        """The first SIGTERM / Ctrl-C, said by the watcher thread when it lands (the main thread may be in a
        long native call)."""
        logger.warning(
            "received %s: will checkpoint after the current step and exit (a second SIGTERM or Ctrl-C "
            "stops at once, without saving it)",
            signal.Signals(signum).name,
        )

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self._got_term = self._got_term or signum == signal.SIGTERM
        if self.signum is None:
            if signum not in STOP_NOW:  # SIGTERM and SIGINT are announced by the watcher (_announce)
                logger.warning(
                    "received %s: will checkpoint after the current step and exit", signal.Signals(signum).name
                )
            self.signum = signum
        _STOP_REQUESTED.set()

    def _local_code(self) -> int:
        """This rank's wish: 0 (go on), 130 (Ctrl-C) or 143 (signal or budget)."""
        now = time.monotonic()
        self._longest = max(self._longest, now - self._last_check)
        self._last_check = now
        if self.signum is not None:
            return EXIT_INTERRUPTED if self.signum == signal.SIGINT else EXIT_PREEMPTED
        if self._end is not None and now + self._longest + self._margin > self._end:
            logger.warning(
                "time budget: %.0fs left, a step (+ checkpoint) takes up to %.0fs and the margin is %.0fs: "
                "checkpointing now",
                self._end - now,
                self._longest,
                self._margin,
            )
            self._budget_hit = True
            return EXIT_PREEMPTED
        return 0

    def should_stop(self) -> bool:
        """Collective: True on every rank when any rank got a signal or ran out of time."""
        import torch  # here, not at the top: the launcher and the tools' --help import no torch
        import torch.distributed as dist

        code = self._local_code()
        wants_requeue = self._budget_hit or self.signum == signal.SIGUSR1
        # [exit code, some rank wants a requeue, some rank got SIGTERM]; MAX over ranks for each.
        t = torch.tensor([code, int(wants_requeue), int(self._got_term)], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized():
            # nccl reduces device tensors only; gloo takes the CPU tensor as is.
            if dist.get_backend() == "nccl":
                t = t.cuda()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # 143 wins over 130: a scheduler is waiting
        code, wants, term = (int(v) for v in t.tolist())
        self.exit_code = code
        self.requeue = bool(code and wants and not term)  # a user's scancel (SIGTERM) is never requeued
        if code:
            self.reason = "SIGTERM" if term else ("SIGINT" if code == EXIT_INTERRUPTED else "")
            self.reason = self.reason or ("SIGUSR1" if self.signum == signal.SIGUSR1 else "time budget")
        return code != 0

    def write_requeue_marker(self, step: int, total_steps: int = 0) -> None:
        """Collective, after the final checkpoint: when :attr:`requeue` and the batch script asked for
        it (``$PACS_REQUEUE_MARKER``), rank 0 writes ``{"step", "reason", "job_id"}`` there; every
        rank waits for it, so no rank's exit can get rank 0 killed before the marker exists. Nothing
        when ``step`` was the last one (``total_steps``): there is nothing left to continue."""
        import torch.distributed as dist

        path = os.environ.get(REQUEUE_MARKER_ENV)
        if not (self.requeue and path) or (total_steps and step >= total_steps):
            return
        if not dist.is_initialized() or dist.get_rank() == 0:
            info = {"step": step, "reason": self.reason, "job_id": os.environ.get("SLURM_JOB_ID", "")}
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                f.write(json.dumps(info) + "\n")
            os.replace(tmp, path)  # whole or absent: the script never reads half a marker
        if dist.is_initialized():
            dist.barrier()
