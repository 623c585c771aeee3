"""Start N local ranks of a command, as ``torchrun --standalone`` would, so one-line commands work
without a launcher. Under torchrun / srun (RANK and WORLD_SIZE set) nothing is spawned: :func:`on_ranks`
makes that choice for every command (train, export, parity, the benchmarks).

The parent forwards SIGTERM / SIGUSR1 / SIGINT to every child (they checkpoint and exit 143, or 130
after Ctrl-C; a second Ctrl-C stops them at once), and when one child fails it gives the others a
grace period, then kills them, like torchrun. As torchrun does, each child runs in its own session:
a terminal's Ctrl-C reaches only the parent, which forwards it once to the ranks and not to their
helper processes (reward workers), so nothing dies with a KeyboardInterrupt traceback. The children
die with the parent (PR_SET_PDEATHSIG on Linux), so killing the parent never leaves ranks behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from pacs_megatron.utils.dist import free_port, under_launcher
from pacs_megatron.utils.logging import get_logger
from pacs_megatron.utils.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED
from pacs_megatron.utils.proc import die_with_parent

logger = get_logger(__name__)

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
GRACE_S = 30.0


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """Environment of local rank ``rank``; CPU threads are split between the ranks."""
    threads = max(1, (os.cpu_count() or 1) // world_size)
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", str(threads)),
        PACS_LAUNCHER_KIND="local",  # recorded in launch.json
    )
    return env


def on_ranks(module_argv: list[str], world_size: int, rank_main: Callable[[], int]) -> int:
    """Start ``world_size`` local ranks unless a launcher already did: the one place commands decide it.

    Inside a rank (torchrun, srun, Ray or this spawner set RANK and WORLD_SIZE), or when one rank is
    enough, ``rank_main()`` runs here and its exit code is returned. Otherwise ``python -m
    <module_argv...>`` starts as ``world_size`` ranks (:func:`spawn_local`), each of which comes back here
    as a rank, and the job's exit code is returned.
    """
    if under_launcher() or world_size <= 1:
        return rank_main()
    return spawn_local(module_argv, world_size)


def spawn_local(module_argv: list[str], world_size: int) -> int:
    """Run ``python -m <module_argv...>`` as ``world_size`` ranks; return the job's exit code."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", *module_argv],
            env=rank_env(r, world_size, port),
            start_new_session=True,
            preexec_fn=die_with_parent,  # async-signal-safe: one prctl call
        )
        for r in range(world_size)
    ]
    logger.info("started %d local ranks (pids %s)", world_size, [p.pid for p in procs])

    def forward(signum, frame):  # noqa: ARG001
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
                if any(c not in (None, 0, EXIT_INTERRUPTED, EXIT_PREEMPTED) for c in codes):
                    logger.error("a rank exited with %s; stopping the others", codes)
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    codes = [p.returncode for p in procs]
    return next((c for c in codes if c != 0), 0)
