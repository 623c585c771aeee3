"""The sandbox's levels by name, what each enforces and leaves open, and how the level in force is put on
record (the run's summary, the first metrics row, eval's output).

- ``auto`` / ``bwrap``: bubblewrap. ``auto`` is bubblewrap or a refusal, never a fallback.
- ``rlimits-trusted``: no bubblewrap; root only, set by name. For code you would run on the host yourself:
  the host's world-readable files stay readable (docs/tools.md's table lists what is open).

The old name ``rlimits`` is refused with the new name in the message rather than mapped to it: it allowed a
non-root trainer (the code then ran as the trainer's uid) and read like the fallback ``auto`` used to take,
so a config carrying it is asked to say ``rlimits-trusted`` once, knowingly.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pacs_megatron.envs.sandbox import Sandbox

LEVELS = ("auto", "bwrap", "rlimits-trusted")
"""The values of ``tools.sandbox``."""
RENAMED = {"rlimits": "rlimits-trusted"}
"""Old names refused with a message naming the new setting."""
LEVEL_CODES = {"bwrap": 2.0, "rlimits-trusted": 1.0}
"""``tools/sandbox_level`` in the first metrics row (metrics are numbers)."""
INSTALL = "apt-get install bubblewrap"


def check_name(level: str, key: str, error: type[Exception]) -> None:
    """Raise ``error`` in one line for a name that is not a level (a renamed one says its new name)."""
    if level in RENAMED:
        raise error(
            f"{key}={level} is renamed {key}={RENAMED[level]}: it is for code you trust (no bubblewrap: the "
            f"host's readable files stay readable; root only): set {key}={RENAMED[level]} to accept that, or "
            f"{INSTALL} and use {key}=auto"
        )
    if level not in LEVELS:
        raise error(f"{key}={level!r} is not valid: choose one of {list(LEVELS)}")


def bwrap_refusal(key: str, level: str, problem: str) -> str:
    """The one line that stops a run whose bubblewrap cannot start: what is missing, the install, the setting."""
    # a container masks parts of /proc (bwrap cannot mount its own then), and docker's seccomp profile refuses
    # user namespaces without CAP_SYS_ADMIN: docs/tools.md, "In a container"
    where = (
        "; in a container: podman run --security-opt unmask=/proc/*, docker run --security-opt "
        "systempaths=unconfined --security-opt seccomp=unconfined"
        if _in_container()
        else ""
    )
    return (
        f"{key}={level} but bubblewrap cannot start a sandbox here ({problem}): {INSTALL} (it needs unprivileged "
        f"user namespaces: sysctl user.max_user_namespaces > 0{where}), or accept a weaker level with "
        f"{key}=rlimits-trusted (root only; host files stay readable: docs/tools.md)"
    )


def _in_container() -> bool:
    """Docker and podman leave these files in every container they start."""
    return os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")


def non_root_refusal(key: str, uid: int) -> str:
    """Why ``rlimits-trusted`` is refused for a non-root trainer, and the fix."""
    return (
        f"{key}=rlimits-trusted is refused for a non-root trainer (uid {uid}): the code would run as the "
        f"trainer's own uid (it could kill the trainer, read /proc/<pid>/environ, write its files): {INSTALL} "
        f"and use {key}=auto"
    )


def enforced(sb: Sandbox) -> list[str]:
    """What a call at ``sb``'s level is held to here, one item each."""
    lim, plan = sb.limits, sb.memory
    who = "a private uid per call (the trainer is root)" if sb.private else "the trainer's own uid"
    items = [
        f"one fresh process per call, as {who}; {sb.interp.path} -I -S -B (no site-packages)",
        "environment: PATH, LANG, HOME, TMPDIR, one BLAS thread; nothing of the trainer's",
        f"CPU {lim.cpu_seconds:g} s per process (RLIMIT_CPU); address space {plan.process_mb} MiB per process",
        f"wall {lim.wall_seconds:g} s per call, then every process of the call is killed",
        f"output: {lim.output_bytes} bytes kept per stream; one more stops the call",
    ]
    if plan.per_call:
        items.append(plan.describe())
    if sb.level == "bwrap":
        items += [
            "new user, pid, network, mount, ipc and uts namespaces (bubblewrap): network is loopback only; the "
            "host's processes, /proc and the trainer's environment are out of sight",
            f"file system: /usr, the interpreter and the packages read-only; a private {plan.tmp_mb} MiB tmpfs /tmp "
            "(cwd, HOME) gone after the call; nothing else of the host (run dir, cwd, /work, homes, /etc)",
        ]
    else:
        items += [
            "new network namespace (loopback only), pid namespace (the call sees only its own processes; pid 1 "
            "is root's and dies with the call, killing what is left), mount, ipc and uts namespaces",
            f"private tmpfs on /tmp ({plan.tmp_mb} MiB, cwd and HOME), /var/tmp, /dev/shm, /run/lock: the host's "
            "are untouched and nothing is kept between calls",
        ]
    return items


def not_enforced(sb: Sandbox) -> list[str]:
    """What a call at ``sb``'s level can still do here, one item each."""
    items = ["system calls are not filtered (no seccomp)"]
    if not sb.memory.per_call:
        items.append(sb.memory.describe())
    if sb.level == "rlimits-trusted":
        items += [
            "file reads: the host's file system is the host's: what any user may read (world-readable files, "
            "e.g. the repository's) is readable",
            "unix sockets on the host's file system that any user may connect to (e.g. a D-Bus socket)",
            "user namespaces: the code may create its own (unprivileged, as any user here)",
        ]
    return items


def describe(sb: Sandbox) -> str:
    """``sandbox level: X`` then ``enforced:`` and ``NOT enforced:`` lines (docs/tools.md shows one)."""
    lines = [f"sandbox level: {sb.level}"]
    lines += [f"  enforced: {s}" for s in enforced(sb)] + [f"  NOT enforced: {s}" for s in not_enforced(sb)]
    return "\n".join(lines)


def record(sb: Sandbox) -> dict[str, Any]:
    """The level in force and its limits, as final.json's ``tool_sandbox`` and eval's output hold them."""
    plan, lim = sb.memory, sb.limits
    return {
        "level": sb.level,
        "uid": "private" if sb.private else "trainer",
        "memory_cap": plan.cap,
        "memory_mb_per_call": plan.call_mb if plan.per_call else None,
        "memory_mb_per_process": plan.process_mb,
        "max_processes": plan.processes or None,
        "tmp_mb": plan.tmp_mb,
        "cpu_seconds": lim.cpu_seconds,
        "wall_seconds": lim.wall_seconds,
        "not_enforced": not_enforced(sb),
    }


def start_metrics(rec: dict[str, Any]) -> dict[str, float]:
    """The record as the first metrics row's numbers: ``tools/sandbox_level`` (2 bwrap, 1 rlimits-trusted),
    ``tools/sandbox_memory_mb`` (per call; -1 where only per process), ``tools/sandbox_max_processes`` (-1:
    unbounded), ``tools/sandbox_process_memory_mb``.

    Example:
        >>> start_metrics({"level": "bwrap", "memory_mb_per_call": 1024, "max_processes": 64,
        ...                "memory_mb_per_process": 1024})["tools/sandbox_level"]
        2.0
    """
    return {
        "tools/sandbox_level": LEVEL_CODES[rec["level"]],
        "tools/sandbox_memory_mb": float(rec["memory_mb_per_call"] or -1),
        "tools/sandbox_max_processes": float(rec["max_processes"] or -1),
        "tools/sandbox_process_memory_mb": float(rec["memory_mb_per_process"]),
    }
