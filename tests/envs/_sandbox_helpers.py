"""What the sandbox tests share: calm limits, the level skips, and the check that no call left a process."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from pacs_megatron.envs import isolation
from pacs_megatron.envs.sandbox import Limits, SandboxError, check_sandbox

# generous wall limits: a loaded 2-core machine starts a sandbox in 0.1-2 s; the limit tests set their own
CALM = Limits(cpu_seconds=5, wall_seconds=60, memory_mb=512, max_processes=16, output_bytes=16384)


def skip_unless_level(level: str) -> str:
    """``level`` where this machine can start it, else a skip saying why."""
    if level == "rlimits-trusted" and os.geteuid() != 0:
        pytest.skip(f"rlimits-trusted runs only for a root trainer (this test runs as uid {os.geteuid()})")
    try:
        check_sandbox(level)
    except SandboxError as e:
        pytest.skip(f"{level} cannot start here: {e}")
    return level


def startable_level() -> str:
    """A level this machine can start, for tests of the tools rather than of the sandbox: bubblewrap, else (as
    root) rlimits-trusted, else a skip naming the install."""
    for level in ("auto", "rlimits-trusted"):
        try:
            check_sandbox(level)
            return level
        except SandboxError as e:
            reason = str(e)
    pytest.skip(f"no sandbox level starts here: {reason}")


def leftovers() -> list[str]:
    """Processes of a sandbox still alive: its bootstrap marker in the command line, or a private uid."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            uid = p.info["uids"].real if p.info["uids"] else -1
        except (psutil.Error, TypeError):
            continue
        if isolation.MARKER in cmd or isolation.PRIVATE_UID_BASE <= uid < isolation.PRIVATE_UID_BASE + 5 * 10**8:
            found.append(f"{p.info['pid']} uid={uid} {cmd[:80]}")
    return found


def no_leftovers(within_s: float = 10.0) -> None:
    """Every process of every call is gone within ``within_s`` (the kill is asynchronous)."""
    deadline = time.monotonic() + within_s
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left
