"""The Ray actor that hosts one trainer rank (used by :mod:`pacs_megatron.launch.ray_launcher`).

The actor does not run :func:`pacs_megatron.loop.train.train` in its own process: it starts the same
module entry as a torchrun rank, ``python -m pacs_megatron.launch --config FILE``, as a child with
the rank's environment, and waits for it (another :class:`RankProgram`, e.g. ``doctor
--distributed``, runs the same way). Why a child process:

- signals: the trainer's SIGTERM/SIGINT handlers (checkpoint, then exit) need the main thread of a
  process that owns its signal dispositions; a Ray worker's main thread belongs to Ray, which also
  reacts to SIGTERM itself. The driver forwards a signal with :meth:`RankActor.signal`.
- failures: a crash, ``sys.exit`` or OOM of the trainer is an exit code and a stderr tail, never a
  broken actor; the actor is only ever lost when its process is (node lost, killed).
- state: megatron-core keeps process-global state (parallel_state, CUDA context, gloo groups); a
  fresh interpreter per launch is what torchrun gives a rank, so the results match bit for bit.

The child dies with the actor (``PR_SET_PDEATHSIG``), so a killed actor never leaves a trainer rank
blocked in a collective. Its stderr is copied line by line to the actor's stderr, which Ray streams
to the driver (prefixed ``(rank0 pid=..., ip=...)``), and the last lines are kept for the driver's
error message. The actor is threaded (``max_concurrency``) so ``signal`` runs while ``run`` waits.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections import deque
from dataclasses import dataclass

from pacs_megatron.utils.proc import die_with_parent

_TAIL_LINES = 30


@dataclass(frozen=True)
class RankProgram:
    """What every rank of a Ray job runs: ``python -m module *args``.

    Example: ``RankProgram("pacs_megatron.tools.doctor_distributed", ("--dir", "/shared"), capture_stdout=True)``
    """

    module: str = "pacs_megatron.launch"
    """A module of this package with a ``__main__`` entry that runs one rank (RANK etc. from the environment)."""
    args: tuple[str, ...] = ()
    """Its arguments; the trainer's ``--config FILE`` is added by the actor (the file is written on its node)."""
    capture_stdout: bool = False
    """Return the rank's whole stdout instead of streaming it: Ray streams actor output asynchronously
    and line-prefixed, so a report printed just before exit may reach the driver late, or not at all."""


TRAINER = RankProgram()


@dataclass(frozen=True)
class RankResult:
    """How one rank ended: its exit code, last stderr lines (for the driver's error), captured stdout."""

    code: int
    tail: list[str]
    stdout: str = ""


class RankActor:
    """One trainer rank on a Ray node (created with ``ray.remote(...)`` by the launcher)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.rank = index
        self.proc: subprocess.Popen | None = None
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)

    def __repr__(self) -> str:  # Ray prefixes the streamed log lines with it
        return f"rank{self.rank}"

    def where(self) -> dict:
        """This actor's node: Ray node id, address, host name, assigned GPU ids."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def host_store(self) -> int:
        """Rank 0's actor: start the job's rendezvous store (a TCPStore server) on a port the kernel
        assigns as it binds, and return that port. The ranks connect to it as clients
        (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun's agent): no port is picked by
        bind-and-close and taken by someone else before rank 0 binds it. It lives with the actor."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        self._store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=30))
        return self._store.port

    def run(
        self, rank: int, config_yaml: str, env: dict[str, str], cwd: str, program: RankProgram = TRAINER
    ) -> RankResult:
        """Run the rank's program to completion (the trainer unless ``program`` says otherwise)."""
        self.rank = rank
        workdir = tempfile.mkdtemp(prefix=f"pacs-rank{rank}-")
        argv = [sys.executable, "-m", program.module, *program.args]
        if program.module == TRAINER.module:
            # The resolved config travels with the call; the run's directories (absolute paths, made so by
            # the driver) must still be on a filesystem every node sees, which the rank checks at start.
            config_path = os.path.join(workdir, "config.yaml")
            with open(config_path, "w") as f:
                f.write(config_yaml)
            argv += ["--config", config_path]
        if not os.path.isdir(cwd):
            sys.stderr.write(
                f"rank {rank}: the driver's working directory {cwd} is not on this node: running in {workdir}\n"
            )
            cwd = workdir
        full_env = dict(os.environ) | env
        self.proc = subprocess.Popen(
            argv,
            env=full_env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if program.capture_stdout else None,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - only an async-signal-safe prctl call
        )
        copier = threading.Thread(target=self._copy_stderr, daemon=True)
        copier.start()
        out = self.proc.stdout
        stdout = out.read() if program.capture_stdout and out is not None else ""  # until the rank closes it (exits)
        code = self.proc.wait()
        copier.join(timeout=5.0)
        return RankResult(code, list(self.tail), stdout)

    def _copy_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.strip():
                self.tail.append(line.rstrip("\n"))

    def signal(self, signum: int) -> bool:
        """Forward ``signum`` to the trainer rank; False when it is not running."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        self.proc.send_signal(signum)
        return True
