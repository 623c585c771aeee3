"""One memory and process cap per tool call: a cgroup per call where the hierarchy is writable, else the
processes x memory of the call held to its budget by rlimits (:func:`memory_plan`).

A call's cgroup is made beside the trainer's own (v2: a sibling, as the "no internal processes" rule wants;
v1: a child of the trainer's memory and pids cgroups, so the trainer's own limits still count it) with
``memory.max`` / ``memory.limit_in_bytes``, no swap, and ``pids.max``. The call's first process joins it
before anything of the call runs (envs/enter.py); ending the call kills the cgroup (``cgroup.kill``, or on
v1 every pid listed until none is left) and removes it. docs/tools.md, "One memory cap per call".
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
import time
from dataclasses import dataclass

BASE = "pacs-megatron-tools"
"""The folder of the per-call cgroups (made once, left in place, empty between calls)."""
SANDBOX_TASKS = 4
"""Tasks of the sandbox itself in a call's cgroup (enter stage, pid 1, bwrap's two) on top of its processes."""
PROCESS_FLOOR_MB = 192
"""The least address space a process of a call gets where the budget is split by rlimits: Python with numpy
and sympy imported needs 150-190 MiB of it (docs/tools.md, "One memory cap per call")."""


@dataclass(frozen=True)
class Hierarchy:
    """A writable place for per-call cgroups: v2 (one folder) or v1 (the memory folder, the pids folder)."""

    version: int
    bases: tuple[str, ...]

    def create(self, memory_mb: int, max_tasks: int) -> CallGroup:
        """A fresh cgroup per folder of :attr:`bases` with the call's limits set."""
        name = f"call-{os.getpid()}-{secrets.token_hex(4)}"
        dirs = [os.path.join(base, name) for base in self.bases]
        for d in dirs:
            os.mkdir(d)
        group = CallGroup(self.version, dirs)
        try:
            limit = str(memory_mb << 20)
            if self.version == 2:
                _write(dirs[0], "memory.max", limit)
                _write(dirs[0], "memory.swap.max", "0", missing_ok=True)
                _write(dirs[0], "pids.max", str(max_tasks))
            else:
                _write(dirs[0], "memory.limit_in_bytes", limit)
                _write(dirs[0], "memory.memsw.limit_in_bytes", limit, missing_ok=True)  # no swap past it
                _write(dirs[1], "pids.max", str(max_tasks))
        except OSError:
            group.remove()
            raise
        return group


class CallGroup:
    """One call's cgroup(s): the ``cgroup.procs`` files the call joins, its kill, its OOM count, its removal."""

    def __init__(self, version: int, dirs: list[str]) -> None:
        self.version, self.dirs = version, dirs

    @property
    def procs_files(self) -> list[str]:
        """Where the call's first process writes its pid (every controller's folder)."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def kill(self) -> None:
        """SIGKILL every process in the cgroup: ``cgroup.kill`` (v2, Linux >= 5.14), else each listed pid
        until the list is empty (v1: pids.max bounds how many a fork loop can add meanwhile)."""
        kill_file = os.path.join(self.dirs[0], "cgroup.kill")
        if self.version == 2 and os.path.exists(kill_file):
            _write(self.dirs[0], "cgroup.kill", "1")
            return
        for _ in range(200):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def pids(self) -> list[int]:
        """The processes in the call's cgroup(s) now."""
        out: set[int] = set()
        for path in self.procs_files:
            try:
                with open(path) as f:
                    out.update(int(x) for x in f.read().split())
            except FileNotFoundError:
                pass
        return sorted(out)

    def oom_kills(self) -> int:
        """Processes the kernel killed for the cgroup's memory limit (v2 memory.events, v1 memory.oom_control)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.dirs[0], name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def peak_mb(self) -> float | None:
        """The call's highest memory use (v2 memory.peak, Linux >= 5.19; v1 memory.max_usage_in_bytes)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            with open(os.path.join(self.dirs[0], name)) as f:
                return int(f.read().split()[0]) / 2**20
        except (OSError, ValueError, IndexError):
            return None

    def remove(self) -> None:
        """Remove the cgroup(s); a folder still busy with dying processes is retried for up to 5 s."""
        for d in self.dirs:
            for _ in range(500):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _write(folder: str, name: str, value: str, missing_ok: bool = False) -> None:
    path = os.path.join(folder, name)
    if missing_ok and not os.path.exists(path):
        return
    with open(path, "w") as f:
        f.write(value)


def _mounts() -> dict[str, str]:
    """Mount points of the cgroup hierarchies: "2" for the v2 one, a v1 controller's name for its own."""
    found: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3].split(",")
            if fstype == "cgroup2":
                found.setdefault("2", fields[4])
            elif fstype == "cgroup":
                for opt in options:
                    found.setdefault(opt, fields[4])
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup per hierarchy ("2" for v2, else each v1 controller), from /proc/self/cgroup."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else ["2"]:
                out[c] = path
    return out


def _make_base(parent: str, enable: str | None) -> str:
    """``parent/BASE``, made writable for per-call cgroups (a test child made and removed), or OSError."""
    if enable is not None:
        _write(parent, "cgroup.subtree_control", enable)
    base = os.path.join(parent, BASE)
    os.makedirs(base, exist_ok=True)
    if enable is not None:
        _write(base, "cgroup.subtree_control", enable)
    probe = os.path.join(base, f"probe-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(probe)
    os.rmdir(probe)
    return base


@functools.cache
def find_hierarchy() -> Hierarchy | str:
    """Where per-call cgroups can be made here, or why none can (one phrase). Cached per process."""
    try:
        mounts, own = _mounts(), _own_paths()
    except (OSError, ValueError) as e:
        return f"cgroups unreadable ({e})"
    problems = []
    if "2" in mounts and "2" in own:
        root = mounts["2"]
        try:
            with open(os.path.join(root, "cgroup.controllers")) as f:
                controllers = f.read().split()
        except OSError:
            controllers = []
        if {"memory", "pids"} <= set(controllers):
            own_dir = os.path.normpath(os.path.join(root, own["2"].lstrip("/")))
            parent = own_dir if own_dir == root else os.path.dirname(own_dir)
            try:
                return Hierarchy(2, (_make_base(parent, "+memory +pids"),))
            except OSError as e:
                problems.append(f"cgroup v2 at {parent} not writable ({e.strerror})")
        else:
            problems.append(f"cgroup v2 at {root} has no memory and pids controllers")
    if "memory" in mounts and "pids" in mounts:
        try:
            bases = tuple(
                _make_base(os.path.normpath(os.path.join(mounts[c], own.get(c, "/").lstrip("/"))), None)
                for c in ("memory", "pids")
            )
            return Hierarchy(1, bases)
        except OSError as e:
            problems.append(f"cgroup v1 memory/pids not writable ({e.strerror})")
    return "; ".join(problems) or "no cgroup hierarchy with memory and pids controllers is mounted"


@dataclass(frozen=True)
class MemoryPlan:
    """How one call's memory and processes are held to ``tools.memory_mb`` here."""

    cap: str
    """"cgroup-v2" / "cgroup-v1" (one cap for the call), "rlimits" (processes x address space within the
    budget: a private uid's RLIMIT_NPROC), or "none" (per process only: no cgroup and no private uid)."""
    call_mb: int
    process_mb: int
    """RLIMIT_AS of each process."""
    processes: int
    """Processes (threads count) the call may run at once; 0 where nothing bounds them."""
    tmp_mb: int
    """Size of the call's private /tmp (a tmpfs, charged to the call's cgroup where there is one)."""
    why: str = ""
    """Why no cgroup holds the call ("" where one does)."""

    @property
    def per_call(self) -> bool:
        """One call cannot hold more than ``call_mb`` (its files on /tmp included)."""
        return self.cap != "none"

    def describe(self) -> str:
        """One line: what bounds the call's memory."""
        if self.cap.startswith("cgroup"):
            return (
                f"memory {self.call_mb} MiB per call, its /tmp included, and {self.processes} processes "
                f"({self.cap}: memory.max/pids.max; the cgroup is killed at the end)"
            )
        if self.cap == "rlimits":
            return (
                f"memory {self.call_mb} MiB per call as {self.processes} processes x {self.process_mb} MiB plus a "
                f"{self.tmp_mb} MiB /tmp (no writable cgroup here: {self.why})"
            )
        return (
            f"memory NOT capped per call: {self.process_mb} MiB per process, processes unbounded until the wall "
            f"limit (no writable cgroup: {self.why}; no private uid: the trainer is not root)"
        )


def memory_plan(memory_mb: int, max_processes: int, private: bool, hierarchy: Hierarchy | str) -> MemoryPlan:
    """The plan for a call of ``memory_mb`` and ``max_processes`` (see :class:`MemoryPlan`). Without a cgroup
    but with a private uid, /tmp gets a quarter of the budget, /dev/shm up to 64 MiB of it, and the rest is
    split into as many processes of at least :data:`PROCESS_FLOOR_MB` as ``max_processes`` allows (at least 1).

    Example:
        >>> memory_plan(1024, 64, True, "no cgroup").processes, memory_plan(1024, 64, True, "no cgroup").process_mb
        (3, 234)
    """
    if isinstance(hierarchy, Hierarchy):
        return MemoryPlan(f"cgroup-v{hierarchy.version}", memory_mb, memory_mb, max_processes, memory_mb)
    if not private:
        return MemoryPlan("none", memory_mb, memory_mb, 0, memory_mb, hierarchy)
    tmp_mb = max(16, memory_mb // 4)
    share = max(1, memory_mb - tmp_mb - min(64, tmp_mb))
    processes = max(1, min(max_processes, share // PROCESS_FLOOR_MB))
    return MemoryPlan("rlimits", memory_mb, share // processes, processes, tmp_mb, hierarchy)
