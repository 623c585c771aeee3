"""Helper processes that follow the process that started them.

Two rules keep a stop clean:

- **Die with the parent** (:func:`die_with_parent`): the kernel SIGKILLs the child when its parent
  dies (Linux ``PR_SET_PDEATHSIG``), so a killed launcher or trainer leaves nothing behind. Used for
  the trainer ranks of the local and Ray launchers, and for every helper.
- **Helpers leave the stop signals to their rank** (:func:`helper_process`: reward workers, engine
  processes): SIGTERM / SIGUSR1 / SIGINT
  are often sent to a whole process group or job step (``scancel``, ``kill -TERM -PGID``, Ctrl-C
  in a terminal). The trainer answers them by finishing its step and checkpointing, which still
  needs its helpers; a helper that died of the same signal would turn that checkpoint into a
  BrokenPipeError. Helpers ignore them and are ended by their parent instead.

And two keep the job's work fast: **its Ray actors run at the job's priority** (:func:`ray_job_runtime_env`), and
**a process ends without the interpreter's teardown** (:func:`run_main`).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

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


RAY_NICENESS = "RAY_worker_niceness"


def ray_job_runtime_env() -> dict[str, dict[str, str]]:
    """The ``runtime_env`` of a Ray actor that does the job's own work (trainer ranks, rollout engines,
    reward workers): niceness 0, or the driver's ``RAY_worker_niceness`` where it sets one.

    Ray starts its worker processes at niceness 15 (its ``worker_niceness``) to keep the raylet responsive,
    and a rank or engine process inherits its actor's, which starved it beside nice-0 processes (measured:
    docs/launch.md, "Ray"). Ray's job supervisor asks for 0 for its own actor the same way.
    """
    return {"env_vars": {RAY_NICENESS: os.environ.get(RAY_NICENESS, "0")}}


_RETURNED: list[int | str | None] = []


def run_main(main: Callable[[], int | str | None]) -> NoReturn:
    """Run a process's entry point (``python -m pacs_megatron``, the console script, a torchrun rank) and exit
    with what it returned, without the interpreter's teardown after the ``atexit`` handlers.

    That teardown (a full cycle collection, then every module's) costs seconds of CPU per rank that imported
    torch, megatron and transformers (docs/benchmarks.md, "A launch's start and exit"). ``atexit`` runs its
    handlers in reverse, so the one registered here runs after those registered later: non-daemon threads are
    joined and the libraries' handlers (Ray's, vLLM's, torch's, multiprocessing's) have run when it shuts
    logging down, flushes the standard streams and calls :func:`os._exit`. An entry point therefore calls it
    before importing anything that registers a handler (logging, imported by then, is shut down here).
    Skipped: collecting what is still alive (the project closes its files and writers itself) and C-level
    exit hooks, such as nanobind's leak report (triton's), which ``gc.freeze`` instead would set off.
    When ``main`` raises, the interpreter exits as usual (traceback, 1).

    One handler registered *before* this one would be skipped and matters: multiprocessing's (its exit function
    terminates its daemonic children and joins the others), registered when ``multiprocessing`` is first
    imported. The engine process and the reward worker import it before their entry point runs (their
    protocol is a ``multiprocessing.connection``), so the exit calls that function itself when multiprocessing
    is loaded; it runs once (its own flag), so a handler registered after this one is no second join."""
    atexit.register(_exit_now)
    code = main()
    _RETURNED.append(code)
    sys.exit(code)


def _exit_now() -> None:
    if not _RETURNED:  # main raised, or a SystemExit of its own (argparse): the interpreter's usual exit
        return
    code = _RETURNED[0]
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:  # its atexit handler may have been registered before ours, and would be skipped
        mp_util._exit_function()
    logging.shutdown()  # in case logging was imported before this handler was registered
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced stream: nothing left to save
            pass
    os._exit(0 if code is None else code if isinstance(code, int) else 1)  # sys.exit's rule for the code
