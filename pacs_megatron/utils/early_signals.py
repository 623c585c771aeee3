"""Stop signals that arrive while a rank is still starting (imports, model and engine load).

Kept free of heavy imports so that ``python -m pacs_megatron.launch`` installs it first, a few
milliseconds after the interpreter starts: a pre-emption warning (Slurm's ``--signal=B:USR1@T``,
forwarded by the batch script at any time) or a SIGTERM that lands during the minutes of start-up
is recorded here instead of killing the rank with the default action. ``utils/preemption.py``'s
flag picks it up and the run stops after its first step, with a checkpoint.
"""

from __future__ import annotations

import signal
import threading

EARLY_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_received: list[int] = []


def _record(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    # Not preemption.stop_requested(): that makes a reward batch give up early; the first step after
    # start-up should run normally and be checkpointed.
    if not _received:
        _received.append(signum)


def install_early_handlers() -> None:
    """Record SIGTERM / SIGUSR1 from now on (main thread only; SIGINT keeps raising KeyboardInterrupt:
    a Ctrl-C during start-up has nothing to save). Idempotent."""
    if threading.current_thread() is threading.main_thread():
        for s in EARLY_SIGNALS:
            if signal.getsignal(s) is not _record:
                signal.signal(s, _record)


def early_signal() -> int | None:
    """The first stop signal recorded before the loop's own handler took over, or None."""
    return _received[0] if _received else None


def restore_default_handlers() -> None:
    """For a process that turns out not to be a rank (the Ray driver, the local spawner): default
    actions again, and a signal recorded meanwhile is delivered now instead of being lost."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in EARLY_SIGNALS:
        if signal.getsignal(s) is _record:
            signal.signal(s, signal.SIG_DFL)
    if _received:
        signal.raise_signal(_received.pop())


def ignore_late_warnings() -> None:
    """Once the rank's work is done: ignore SIGUSR1 (a pre-emption or time-limit warning) until exit.

    There is nothing left to save, and Python resets every signal it handles to the default action
    when the interpreter shuts down, so a warning landing in the rank's last milliseconds killed it
    (exit 138) and failed a job whose run had completed (seen on the local Slurm: a requeued run got
    its warning a second after its last step). An ignored disposition survives the shutdown. SIGTERM
    keeps its default: a stop request to a process that hangs on its way out should still end it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
