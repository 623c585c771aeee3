"""Checkpoint directories that are either complete or invisible.

Under ``OUTPUT_DIR/checkpoints``: ``step_N/`` is complete (``COMPLETE`` written last, then renamed from
``.tmp_step_N/``, which is never picked up); one that fails :func:`checkpoint_problem` is moved to
``corrupt_step_N/``, never deleted, and the previous one is used. Pruning keeps the newest ``keep_last``
*valid* ones. A save that cannot fit the disk is refused with one line, and a failed write raises
:class:`CheckpointWriteError` naming the directory and the errno. Every rank calls
:meth:`CheckpointManager.save`; rank 0 alone finalises (marker, atomic rename, pruning).
The full-disk checks and error chains: docs/runs.md, "Checkpoints".
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pacs_megatron.run.checkpoint_check import checkpoint_problem
from pacs_megatron.run.layout import RunLayout, StepLayout
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

MARKER = StepLayout(Path()).marker.name
"""The marker's file name (run/layout.py spells it)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, quota, permissions): one line naming the directory."""


T = TypeVar("T")
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")
_FULL = 1 << 20
"""Free bytes below which a failed write is taken for a full disk when the writer gave no errno."""


def _write_errno(exc: BaseException | None) -> int | None:
    """The errno of the OSError behind a failed write: the first in ``exc``'s chain (cause / context), or,
    for torch.distributed.checkpoint's ``CheckpointException`` (a BaseException whose per-rank failures
    megatron's writer workers turned into text, e.g. "Worker failure: [Errno 28] No space left on
    device"), the first ``[Errno N]`` in its failures. None when there is none."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                found = _write_errno(failure) if isinstance(failure, BaseException) else None
                if found:
                    return found
                m = _ERRNO_TEXT.search(str(failure))
                if m:
                    return int(m.group(1))
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _is_write_failure(exc: BaseException) -> bool:
    """An error of the checkpoint writer (caught even though torch's CheckpointException is a BaseException)."""
    return isinstance(exc, Exception) or type(exc).__name__ == "CheckpointException"


def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _gib(n: int) -> str:
    """Bytes for people: "3.2 GiB", "4.9 KiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _barrier() -> None:
    import torch.distributed as dist  # here, not at the top: export's --help imports no torch

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _from_rank0(value: T) -> T:
    """Rank 0's ``value`` on every rank (one decision, even while rank 0 moves directories)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class CheckpointManager:
    """Save, find and prune checkpoints of one run."""

    def __init__(
        self,
        output_dir: str | os.PathLike,
        keep_last: int = 2,
        validate: Callable[[Path], str | None] = checkpoint_problem,
        disk_free: Callable[[Path], int] = _disk_free,
        first_size: int = 0,
    ) -> None:
        self.layout = RunLayout(Path(output_dir))
        self.root = self.layout.checkpoints
        self.keep_last = keep_last
        """Valid checkpoints kept by pruning (0: all)."""
        self.validate = validate
        """Path -> what is wrong with it, or None."""
        self.disk_free = disk_free
        """Path -> free bytes on its file system (shutil.disk_usage)."""
        self.first_size = first_size
        """Estimated bytes of a checkpoint while none exists yet (0: no check before the first save)."""

    def step_dir(self, step: int) -> Path:
        return self.layout.step_dir(step).path

    def complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        return [(step, s.path) for step, s in self.layout.checkpoint_steps()]

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def latest_valid(self) -> Path | None:
        """Newest complete checkpoint that passes validation (collective when distributed: rank 0
        checks, moves damaged ones aside with a warning, and tells the others)."""
        found = None
        if _rank() == 0:
            for _, p in reversed(self.complete()):
                problem = self.validate(p)
                if problem is None:
                    found = str(p)
                    break
                self._move_aside(p, problem, "falling back to the previous checkpoint")
        found = _from_rank0(found)
        return Path(found) if found else None

    def resolve(self, resume: str) -> Path | None:
        """``trainer.resume``: "never" -> None, "auto" -> newest valid checkpoint (or None), else that
        path, which must be complete and valid."""
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest_valid()
        path = Path(resume)
        if not StepLayout(path).is_complete():
            raise FileNotFoundError(
                f"trainer.resume={resume!r} is not a complete checkpoint (no {MARKER} marker): use a "
                f"step_XXXXXXXX directory under {self.root}, 'auto' or 'never'"
            )
        problem = self.validate(path)
        if problem:
            raise FileNotFoundError(
                f"trainer.resume={resume!r} is damaged: {problem}; resume from an older checkpoint "
                f"(e.g. trainer.resume=auto picks the newest valid one under {self.root})"
            )
        return path

    def _move_aside(self, path: Path, problem: str, then: str) -> Path:
        """Rename a damaged checkpoint to ``corrupt_step_N`` (never deleted: the user may salvage it)."""
        n, target = 0, self.layout.corrupt_dir(path.name)
        while target.exists():
            n += 1
            target = self.layout.corrupt_dir(path.name, n)
        os.replace(path, target)
        logger.warning("checkpoint %s is damaged: %s; moved to %s; %s", path, problem, target, then)
        return target

    def space_problem(self) -> str | None:
        """Why the next checkpoint will not fit (free space < the last checkpoint's size, or before the first
        one :attr:`first_size`), or None."""
        latest = self.latest()
        if latest is None and not self.first_size:
            return None
        need = _size(latest) if latest is not None else self.first_size
        where = self.root if self.root.exists() else self.root.parent
        while not where.exists() and where != where.parent:
            where = where.parent
        free = self.disk_free(where)
        if free >= need:
            return None
        size_of = f"the size of {latest.name}" if latest is not None else "estimated from the model's size"
        return (
            f"{self.root} has {_gib(free)} free but a checkpoint takes about {_gib(need)} ({size_of}):"
            " free space there, lower trainer.keep_checkpoints, or point trainer.output_dir at a larger disk"
        )

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Collective: ``write(tmp_dir)`` on every rank, then rank 0 marks and renames atomically."""
        final = self.step_dir(step)
        tmp = self.layout.staging_dir(step)
        problem = None
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            for p in self.layout.staging_dirs():  # a failed save's leftovers take space too
                shutil.rmtree(p, ignore_errors=True)
            problem = self.space_problem()
            if problem is None:
                tmp.mkdir()
        problem = _from_rank0(problem)
        if problem:
            raise CheckpointWriteError(errno.ENOSPC, f"checkpoint step {step} not written: {problem}")
        _barrier()
        start = time.perf_counter()
        try:
            write(tmp)
        except BaseException as e:
            if not _is_write_failure(e):
                raise  # KeyboardInterrupt, SystemExit
            free = self.disk_free(self.root)  # before the partial checkpoint is removed
            code = _write_errno(e)
            checkpoint_exception = type(e).__name__ == "CheckpointException"
            text = f"{e} {getattr(e, 'failures', '')}"
            if code is None and ("unexpected pos" in text or (checkpoint_exception and free < _FULL)):
                code = errno.ENOSPC  # PyTorch's zip writer reports a full disk as "unexpected pos N vs M"
            if code is None and not checkpoint_exception:
                raise  # a bug, not the disk
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            why = f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})" if code else "a rank's writer failed"
            raise CheckpointWriteError(
                code or errno.EIO,
                f"checkpoint step {step} could not be written to {tmp}: {why}; {_gib(free)} was free there; "
                f"the steps so far are logged in {self.layout.metrics}",
            ) from None
        _barrier()
        if _rank() == 0:
            StepLayout(tmp).marker.write_text(json.dumps({"step": step, "time": time.time()}))
            if final.exists():  # re-saving a step (e.g. pre-empted right after a periodic save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
            seconds = time.perf_counter() - start
            logger.info("checkpoint step %d saved to %s in %.1fs (%.1f MB)", step, final, seconds, _size(final) / 1e6)
            warning = self.space_problem()
            if warning:
                logger.warning("the next checkpoint will not fit: %s", warning)
        _barrier()
        return final

    def _prune(self) -> None:
        for p in self.layout.staging_dirs():
            shutil.rmtree(p, ignore_errors=True)
        valid = 0
        for _, p in reversed(self.complete()):
            problem = self.validate(p)
            if problem:
                self._move_aside(p, problem, "it no longer counts towards trainer.keep_checkpoints")
                continue
            valid += 1
            if self.keep_last and valid > self.keep_last:
                shutil.rmtree(p, ignore_errors=True)
