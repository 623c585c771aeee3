"""Helper processes that follow the process that started them.

Two rules keep a stop clean:

- **Die with the parent** (:func:`die_with_parent`): the kernel SIGKILLs the child when its parent
  dies (Linux ``PR_SET_PDEATHSIG``), so a killed launcher or trainer leaves nothing behind. Used for
  the trainer ranks of the local and Ray launchers, and for every helper.
- **Helpers leave the stop signals to their rank** (:func:`helper_process`: reward workers, the
  results-queue server of megatron's checkpoint writer): SIGTERM / SIGUSR1 / SIGINT
  are often sent to a whole process group or job step (``scancel``, ``kill -TERM -PGID``, Ctrl-C
  in a terminal). The trainer answers them by finishing its step and checkpointing, which still
  needs its helpers; a helper that died of the same signal would turn that checkpoint into a
  BrokenPipeError. Helpers ignore them and are ended by their parent instead.
"""

from __future__ import annotations

import ctypes
import signal
import sys

try:  # resolved at import, before any fork: the child side only calls it (async-signal-safe)
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover - no libc to load: best effort, EOF still ends idle helpers
    _LIBC = None
_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""The signals the trainer turns into "checkpoint, then exit" (utils/preemption.py)."""


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere a no-op).

    One prctl call and nothing else, so it is also safe as a ``subprocess.Popen(preexec_fn=...)``.
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def helper_process() -> None:
    """First call in a helper process: ignore the stop signals and die with the parent."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    die_with_parent()
