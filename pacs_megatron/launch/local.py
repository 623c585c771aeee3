"""Start N local ranks of a command, as ``torchrun --standalone`` would, so one-line commands work
without a launcher. Under torchrun / srun (RANK and WORLD_SIZE set) nothing is spawned: :func:`on_ranks`
makes that choice for every command (train, export, parity, the benchmarks).

The parent forwards SIGTERM / SIGUSR1 / SIGINT to every child (they checkpoint and exit 143, or 130
after Ctrl-C). A second SIGTERM or Ctrl-C (utils/preemption.py's StopCounter) is not forwarded: the
parent SIGKILLs every rank, engine and their helpers itself, says in one line that the current step was
not saved and exits 143 / 130 (a rank busy in a native call could not act on it as quickly; SIGKILL
needs no handler). When one child fails the parent gives the others a grace period, then kills them,
like torchrun. As torchrun does, each child runs in its own session:
a terminal's Ctrl-C reaches only the parent, which forwards it once to the ranks and not to their
helper processes (reward workers), so nothing dies with a KeyboardInterrupt traceback. The children
die with the parent (PR_SET_PDEATHSIG on Linux), so killing the parent never leaves ranks behind.

With ``rollout.placement=separate`` the engine processes (launch/engine_rank.py) start beside the
trainer ranks, each told the trainer job's store; the CPU threads are split over all of them (one
core each on this 2-core machine with one trainer rank and one engine). Signals go to the trainer
ranks only: they checkpoint and close the engines, which are stopped if still alive once the
trainer ranks have exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from pacs_megatron.launch.engine_rank import STARTED_ENV, spawn_engines
from pacs_megatron.utils.dist import free_port, under_launcher
from pacs_megatron.utils.logging import get_logger
from pacs_megatron.utils.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, NOT_SAVED, StopCounter, exit_now
from pacs_megatron.utils.proc import die_with_parent

logger = get_logger(__name__)

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
GRACE_S = 30.0


def rank_env(rank: int, world_size: int, port: int, engines: int = 0) -> dict[str, str]:
    """Environment of local rank ``rank``; CPU threads are split between the ranks and ``engines``."""
    threads = max(1, (os.cpu_count() or 1) // (world_size + engines))
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
    if engines:
        env[STARTED_ENV] = "1"
    return env


def on_ranks(module_argv: list[str], world_size: int, rank_main: Callable[[], int], engines=None) -> int:
    """Start ``world_size`` local ranks unless a launcher already did: the one place commands decide it.

    Inside a rank (torchrun, srun, Ray or this spawner set RANK and WORLD_SIZE), or when one rank is
    enough, ``rank_main()`` runs here and its exit code is returned. Otherwise ``python -m
    <module_argv...>`` starts as ``world_size`` ranks (:func:`spawn_local`), each of which comes back here
    as a rank, and the job's exit code is returned. ``engines``: the RunConfig of a
    ``rollout.placement=separate`` run, whose engine processes start beside the ranks, so it spawns
    even at one rank.
    """
    if under_launcher() or (world_size <= 1 and engines is None):
        return rank_main()
    return spawn_local(module_argv, world_size, engines)


def spawn_local(module_argv: list[str], world_size: int, engines=None) -> int:
    """Run ``python -m <module_argv...>`` as ``world_size`` ranks (and ``engines``: the RunConfig whose
    ``rollout.engines`` engine processes start beside them); return the job's exit code."""
    port = free_port()
    count = engines.rollout.engines if engines is not None else 0
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", *module_argv],
            env=rank_env(r, world_size, port, count),
            start_new_session=True,
            preexec_fn=die_with_parent,  # async-signal-safe: one prctl call
        )
        for r in range(world_size)
    ]
    logger.info("started %d local ranks (pids %s)", world_size, [p.pid for p in procs])
    helpers = []
    if count:
        threads = max(1, (os.cpu_count() or 1) // (world_size + count))
        helpers = spawn_engines(engines, f"127.0.0.1:{port}", _first_engine_gpu(world_size), threads)

    stops = StopCounter()

    def forward(signum, frame):  # noqa: ARG001
        if stops.second(signum):  # now: ranks, engines and their helpers are all descendants of this process
            exit_now(signum, NOT_SAVED)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if failed_at is None and any(c not in (None, 0) for c in codes):  # also when all exited at once
                failed_at = time.monotonic()
                if any(c not in (None, 0, EXIT_INTERRUPTED, EXIT_PREEMPTED) for c in codes):
                    logger.error("a rank exited with %s; stopping the others", codes)
            if all(c is not None for c in codes):
                break
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            if failed_at is None and any(h.poll() not in (None, 0) for h in helpers):
                failed_at = time.monotonic()
                logger.error("a rollout engine exited with %s; stopping the ranks", [h.poll() for h in helpers])
            time.sleep(0.2)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        stop_engines(helpers)
    exits = [p.returncode or 0 for p in procs]  # every rank has ended here
    return next((c for c in exits if c != 0), 0)


def stop_engines(helpers: list[subprocess.Popen], wait_s: float = 10.0) -> None:
    """Give engines told to close ``wait_s`` to finish, then kill them (they hold no state)."""
    deadline = time.monotonic() + wait_s
    for h in helpers:
        try:
            h.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            h.kill()
            h.wait()


def _first_engine_gpu(world_size: int) -> int | None:
    """Engines take the GPUs after the trainer ranks' (written for GPU, never run); None on CPU."""
    import torch

    return world_size if torch.cuda.is_available() else None
