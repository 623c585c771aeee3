"""The one owner of ``trainer.output_dir``: a lock, and the rules of a fresh start, a resume and an overwrite.

Two launches into one directory would interleave their logs and fight over checkpoints, and a fresh start
into an old run would leave checkpoints the next auto-resume continues. So rank 0 holds ``OUTPUT_DIR/.lock``
under every launcher (a stale one is taken over when its process is surely gone), a fresh start needs a
directory without a run, an overwrite moves the old run aside whole, and a resume from an older checkpoint
needs ``--overwrite``. :meth:`RunDir.problem` answers all of this without changing anything (the
launcher's preflight); :meth:`RunDir.claim` (rank 0) takes the lock. Neither imports torch.
The rules in full: docs/runs.md, "One run per directory".
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from pacs_megatron.config.base import ConfigError
from pacs_megatron.run.layout import RunLayout, StepLayout
from pacs_megatron.utils.logging import get_logger

if TYPE_CHECKING:
    from pacs_megatron.config import RunConfig

logger = get_logger(__name__)

LOCK = RunLayout(Path()).lock.name
"""The lock's file name (run/layout.py spells it)."""


class RunDirError(ConfigError):
    """The run directory belongs to another run, or a fresh start would mix two runs."""


@dataclass(frozen=True)
class LockInfo:
    """Who holds a run directory.

    Example:
        >>> LockInfo("n1", 42, 1700000000.0, "train").describe()[:23]
        'host n1, pid 42, start '
    """

    host: str
    """socket.gethostname() of the holder."""
    pid: int
    """Its process id on that host."""
    start_time: float
    """Its process creation time (Unix seconds): tells a reused pid from the holder."""
    command: str = ""
    """Its command line, for the user."""
    job: str = ""
    """The scheduler job it belongs to ("slurm:ID", "torchrun:RUN_ID"; "" when none): a requeued or
    restarted attempt of the same job may take over its lock, even from another host."""

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.start_time))
        return f"host {self.host}, pid {self.pid}, start {started}"

    def alive(self) -> bool | None:
        """True/False on the holder's host; None on another host (cannot tell)."""
        if self.host != socket.gethostname():
            return None
        if self.pid <= 0:
            return False
        try:
            proc = psutil.Process(self.pid)
            return abs(proc.create_time() - self.start_time) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False


def job_id() -> str:
    """This process's scheduler job, the same for every attempt of it (Slurm requeue, torchrun restart)."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{os.environ['SLURM_JOB_ID']}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun:{run_id}" if run_id and run_id != "none" else ""


def this_process() -> LockInfo:
    argv = " ".join(sys.argv)[:500]
    return LockInfo(socket.gethostname(), os.getpid(), psutil.Process().create_time(), argv, job_id())


def _checkpoint_steps(root: Path) -> list[int]:
    return [step for step, _ in RunLayout(root).checkpoint_steps()]


class RunDir:
    """Owns ``trainer.output_dir`` for one launch (see the module docstring).

    Example:
        >>> import tempfile
        >>> d = RunDir(tempfile.mkdtemp(), resume="never")
        >>> d.problem() is None, d.claim() is not None, d.release()
        (True, True, None)
    """

    def __init__(self, path: str | os.PathLike, resume: str = "auto", overwrite: bool = False, keep: tuple = ()):
        self.path = Path(path)
        self.layout = RunLayout(self.path)
        self.resume = resume
        """trainer.resume: "auto", "never" or a checkpoint directory."""
        self.overwrite = overwrite
        """trainer.overwrite: move the old run (or newer checkpoints) aside instead of refusing."""
        self.keep = tuple(Path(p).resolve() for p in keep)
        """Paths inside the run dir that an overwrite leaves in place (a model.path written there)."""
        self._held: LockInfo | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> RunDir:
        return cls(cfg.trainer.output_dir, cfg.trainer.resume, cfg.trainer.overwrite, keep=(cfg.model.path,))

    @property
    def lock_path(self) -> Path:
        return self.layout.lock

    def holder(self) -> LockInfo | None:
        """The lock's holder, or None when there is no lock (an unreadable lock counts as stale)."""
        try:
            return LockInfo(**json.loads(self.lock_path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):  # a launch that died between creating and writing it: stale
            return LockInfo(socket.gethostname(), -1, 0.0, "unreadable lock file")

    def lock_problem(self) -> str | None:
        h = self.holder()
        if h is None or (self._held is not None and h == self._held):
            return None
        alive = h.alive()
        if alive is None and h.job and h.job == job_id():
            return None  # an earlier attempt of this same job on another node (requeued, restarted): stale
        if alive:
            return (
                f"trainer.output_dir={self.path} is in use by another run ({h.describe()}): wait for it, stop it "
                "(kill -TERM that pid checkpoints it), or use another trainer.output_dir"
            )
        if alive is None:
            return (
                f"trainer.output_dir={self.path} is locked by a run on another host ({h.describe()}); if that run "
                f"is gone (node lost), delete {self.lock_path} and launch again"
            )
        return None  # stale on this host: claim() takes it over

    def fresh_problem(self) -> str | None:
        """Why this launch would mix two runs, or None."""
        steps = _checkpoint_steps(self.path)
        if self.resume not in ("auto", "never"):
            named = self._named_step()
            newer = [s for s in steps if named is not None and s > named]
            if newer and not self.overwrite:
                return (
                    f"--resume {self.resume} is older than this run's newest checkpoint step {max(newer)}: the "
                    "next auto-resume would continue the newer one; add --overwrite to move the newer checkpoints "
                    "aside (checkpoints/superseded_step_N), or resume with --resume auto"
                )
            return None
        if self.resume == "auto" and steps:
            return None  # a resume
        old = self.old_run()
        if old and self.resume == "never" and not self.overwrite:
            return (
                f"trainer.output_dir={self.path} already holds a run ({', '.join(old)}): --resume never would mix two "
                "runs; use a new trainer.output_dir, or --resume never --overwrite to move the old run aside "
                f"(to {self.path}.old-<time>), or --resume auto to continue it"
            )
        return None

    def _named_step(self) -> int | None:
        """The step of a ``--resume step_N`` directory of this run (None: elsewhere, or not a step dir)."""
        named = Path(self.resume)
        if named.resolve().parent != self.layout.checkpoints.resolve():
            return None
        return StepLayout(named).step

    def old_run(self) -> list[str]:
        """What of an earlier run this directory holds (empty: nothing)."""
        found = [p.name for p in self.layout.run_files if p.exists()]
        steps = _checkpoint_steps(self.path)
        if steps:
            found.append(f"checkpoints up to step {max(steps)}")
        return found

    def problem(self) -> str | None:
        """The first reason this launch may not use the directory, or None. Changes nothing."""
        return self.lock_problem() or self.fresh_problem()

    def claim(self) -> LockInfo:
        """Take the lock (rank 0, before heavy work), then apply an overwrite. Raises RunDirError."""
        self.path.mkdir(parents=True, exist_ok=True)
        me = this_process()
        for _ in range(2):
            try:
                fd = os.open(self.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                problem = self.lock_problem()
                if problem:
                    raise RunDirError(problem) from None
                stale = self.holder()
                logger.warning("taking over the stale lock of a run that is gone (%s)", stale and stale.describe())
                self.lock_path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump(me.__dict__, fh)
            self._held = me
            break
        else:
            raise RunDirError(f"could not take the lock {self.lock_path} (another launch took it at the same time)")
        problem = self.fresh_problem()
        if problem:
            self.release()
            raise RunDirError(problem)
        if self.overwrite:
            self._move_old_run_aside()
        return me

    def _move_old_run_aside(self) -> None:
        if self.resume not in ("auto", "never"):
            self._supersede_newer_checkpoints()
            return
        if not self.old_run() or (self.resume == "auto" and _checkpoint_steps(self.path)):
            return
        target = self.layout.moved_aside(time.strftime("%Y%m%d-%H%M%S"))
        target.mkdir()
        for entry in self.path.iterdir():
            kept = any(entry.resolve() == k or entry.resolve() in k.parents for k in self.keep)
            if entry == self.layout.lock or kept:
                continue
            os.replace(entry, target / entry.name)
        logger.warning("--overwrite: moved the old run of %s to %s (delete it when unneeded)", self.path, target)

    def _supersede_newer_checkpoints(self) -> None:
        named = self._named_step()
        if named is None:
            return
        for step in _checkpoint_steps(self.path):
            if step > named:
                src = self.layout.step_dir(step).path
                os.replace(src, self.layout.superseded_dir(step))
                logger.warning("--overwrite: moved %s aside (resuming from the older %s)", src, self.resume)

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self._held is not None and self.holder() == self._held:
            self.lock_path.unlink(missing_ok=True)
        self._held = None
