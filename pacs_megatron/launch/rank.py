"""The entry every training rank runs through: one readable error per job, not one traceback per rank.

When something fails inside the ranks, every rank usually fails the same way (they run the same
code on the same config), or the others fail *because* one did (a collective whose peer is gone).
So:

- rank 0 logs the error once: one line for a user error (config, data, reward, a file that cannot be
  written: the classification every command shares, launch/errors.py), with the traceback for
  anything else (a bug);
- every other rank logs one line (its own exception, which names the cause when rank 0 only saw
  the fallout) and exits with the same code, 1;
- ``SystemExit`` (pre-emption, an abandoned reward batch) passes through;
- a Ctrl-C that lands before the loop installs its handler (``utils/preemption.py``) exits 130
  with one line: nothing was trained, so there is nothing to save;
- SIGTERM / SIGUSR1 are recorded from the start (before the model and engine load, which take
  minutes on a large model): a pre-emption warning during start-up stops the run after its first
  step with a checkpoint, instead of killing the rank; once the rank's work is done, SIGUSR1 is
  ignored until exit (a warning in the last milliseconds would otherwise kill a finished rank).

Megatron-core warns on import that Apex and Transformer Engine are absent (always true on CPU,
harmless on GPU builds without them): those warnings are filtered here, once per rank, before
megatron is imported, so they do not bury the run's own log.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from pacs_megatron.launch.errors import user_message
from pacs_megatron.utils.early_signals import ignore_late_warnings
from pacs_megatron.utils.logging import get_logger, init_logging, quiet_import_noise
from pacs_megatron.utils.preemption import EXIT_INTERRUPTED, install_early_handlers

logger = get_logger(__name__)

EXIT_FAILED = 1


def quiet_megatron_warnings() -> None:
    # Megatron's TP / sequence-parallel overlap needs the CUDA kernels queued in issue order: one
    # hardware queue (its warning says so, and is left visible). Set before CUDA starts; pre-Blackwell
    # GPUs need it, on Blackwell (sm_100+) users may set another value themselves (docs/launch.md).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    quiet_import_noise()  # before megatron is imported: its import-time notices say nothing about the run


def run_rank(fn: Callable[..., int], *args) -> int:
    """``fn(*args)`` with the error policy above; its exit code, or 1 when it raised."""
    quiet_megatron_warnings()
    install_early_handlers()
    try:
        return fn(*args)
    except KeyboardInterrupt:
        init_logging()
        logger.warning("interrupted while starting up: nothing to save")
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - reported once below
        rank = int(os.environ.get("RANK", "0"))
        init_logging()  # idempotent; the failure may predate the trainer's own logging set-up
        summary = f"{type(e).__name__}: {e}".splitlines()[0]
        if rank != 0:
            logger.error("rank %d failed: %s", rank, summary)
        elif user_message(e) is not None:
            logger.error("%s: %s", type(e).__name__, user_message(e))
            logger.debug("traceback", exc_info=True)
        else:
            logger.error("run failed: %s", summary, exc_info=True)
        return EXIT_FAILED
    finally:
        ignore_late_warnings()  # a warning after the work is done must not kill the exiting rank
