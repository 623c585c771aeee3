"""Graceful stop on SIGTERM / SIGUSR1 (Slurm pre-emption, ``scancel``, a container stop).

The handler only sets a flag; the trainer checks it between steps, agrees across ranks (one rank may
get the signal first), checkpoints, and exits with :data:`EXIT_PREEMPTED` so a requeue script
resumes. ``sbatch --signal=B:USR1@120`` gives two minutes of warning.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

EXIT_PREEMPTED = 143  # 128 + SIGTERM: "terminated", what schedulers and requeue scripts expect
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_STOP_REQUESTED = threading.Event()


def stop_requested() -> bool:
    """Whether this process got a stop signal (for loops that must not wait out a hung step, e.g. rewards)."""
    return _STOP_REQUESTED.is_set()


class PreemptionFlag:
    """Records that a stop signal arrived; ``should_stop()`` is collective over the default group."""

    def __init__(self) -> None:
        self.signum: int | None = None
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self.signum is None:
            logger.warning("received %s: will checkpoint after the current step and exit", signal.Signals(signum).name)
        self.signum = signum
        _STOP_REQUESTED.set()

    def should_stop(self) -> bool:
        flag = torch.tensor([1 if self.signum is not None else 0], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized():
            # nccl reduces device tensors only; gloo takes the CPU tensor as is.
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
