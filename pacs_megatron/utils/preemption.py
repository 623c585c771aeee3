"""Graceful stop: on a signal or when the time budget runs out, checkpoint after the step and exit.

Signals: SIGTERM / SIGUSR1 (Slurm pre-emption and time limits, ``scancel``, a container stop) exit
with :data:`EXIT_PREEMPTED` (143, what requeue scripts test); SIGINT (Ctrl-C) exits with 130. The
handler only records the signal: the trainer asks :meth:`PreemptionFlag.should_stop` between steps,
every rank agrees (an all-reduce: one rank may see the signal first, or alone), checkpoints and
returns :attr:`PreemptionFlag.exit_code`. A second Ctrl-C stops at once (``os._exit(130)``, no
checkpoint, no traceback). A SIGINT within :data:`DUPLICATE_S` of the first is the same Ctrl-C seen
twice, not a second one: torchrun and the local spawner run the ranks in their own sessions and
forward one Ctrl-C once, but a launcher that leaves the ranks in the terminal's process group and
also forwards would deliver it twice.

Time budget (no signal needed): ``trainer.stop_after_s`` (seconds since the launch: the trainer
turns it into a deadline with ``config.training.stop_deadline``) and ``trainer.deadline_unix`` (an
absolute end, e.g. the Slurm job's end time, set by
``launch/slurm.py``). At each check the flag stops when the next step could end after the budget:
``now + longest interval between checks + trainer.stop_margin_s > end``. The interval between two
checks is one step plus any periodic checkpoint, so it also sizes the final save; the margin covers
the save when none has happened yet. Each rank decides on its own clock; the all-reduce makes it one
decision.

Requeue or not: a pre-emption warning (SIGUSR1, what ``--signal=B:USR1@T`` leads to) and the time
budget mean "the job ends soon, continue it later"; SIGTERM means someone ends the job (``scancel``,
a container stop, Slurm's own pre-emption, which requeues by itself with ``PreemptMode=REQUEUE``).
:attr:`PreemptionFlag.requeue` is that decision, agreed by every rank (any SIGTERM wins), and
:meth:`PreemptionFlag.write_requeue_marker` records it for the batch script after the final
checkpoint: the script requeues from that file, never from srun's exit code (a rank exiting 75 is a
"bad exit" to srun, which may then SIGKILL slower ranks and report 137).

Early signals (``utils/early_signals.py``, installed first thing by ``python -m pacs_megatron.launch``
and again by ``launch/rank.py``): a SIGTERM / SIGUSR1 during start-up is recorded instead of killing
the rank; the loop's flag picks it up and stops after its first step.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from pacs_megatron.utils.early_signals import early_signal, install_early_handlers  # noqa: F401 - re-exported
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

EXIT_PREEMPTED = 143  # 128 + SIGTERM: "terminated", what schedulers and requeue scripts expect
EXIT_INTERRUPTED = 130  # 128 + SIGINT: the shell's code for Ctrl-C
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
DUPLICATE_S = 1.0
REQUEUE_MARKER_ENV = "PACS_REQUEUE_MARKER"
"""The file the batch script asks rank 0 to write when the job should be requeued (step, reason)."""
_STOP_REQUESTED = threading.Event()


def stop_requested() -> bool:
    """Whether this process got a stop signal (for loops that must not wait out a hung step, e.g. rewards)."""
    return _STOP_REQUESTED.is_set()


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
        self._sigint_at: float | None = None
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

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        now = time.monotonic()
        if signum == signal.SIGINT:
            if self._sigint_at is not None and now - self._sigint_at > DUPLICATE_S:
                logger.warning("second Ctrl-C: stopping now, without a checkpoint")
                os._exit(EXIT_INTERRUPTED)
            self._sigint_at = self._sigint_at or now
        self._got_term = self._got_term or signum == signal.SIGTERM
        if self.signum is None:
            logger.warning(
                "received %s: will checkpoint after the current step and exit%s",
                signal.Signals(signum).name,
                " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else "",
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
