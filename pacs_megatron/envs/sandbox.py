"""Run untrusted code (the policy's tool calls) in a fresh, limited process per call.

A call never raises into the trainer and never outlives its wall limit::

    Sandbox(level).run(code) -> SandboxResult(kind, stdout, stderr, exit_code, signal, seconds)
        kind: "ok" | "error" (non-zero exit, a traceback) | "timeout" (wall limit) | "cpu_limit" |
              "memory_limit" | "output_limit" (stopped at the byte cap) | "crash" (a signal) | "sandbox_error"

Two levels, chosen by ``tools.sandbox`` and resolved once by :func:`check_sandbox` (preflight calls it before
any heavy work, so a config the machine cannot honour fails in one line):

- ``bwrap``: bubblewrap puts the call in fresh user, pid, network, mount, ipc and uts namespaces: loopback
  only, /usr plus the interpreter and the allowed packages read-only, a private size-limited /tmp as cwd and
  HOME, nothing else of the host; the whole pid namespace dies with the call. Plus everything of ``rlimits``.
- ``rlimits``: a fresh temp dir as cwd and HOME, a clean environment, rlimits (CPU, address space, file
  size, open files, no core dumps), a private uid where the trainer is root (its own process count and file
  permissions). The network and the host's readable files stay reachable: :meth:`Sandbox.describe` says so.

Every call: the code is written to a fresh temp dir (0700; deleted after the call), the interpreter runs with
``-I -S -B`` (no environment variables, site-packages or bytecode writes), the rlimits are set by the child on
itself before the code runs (isolation.py), stdout and stderr are read with a byte cap (a call that prints
more is stopped), and at the end every process of the call is killed: its session, its pid namespace
(bwrap), every process of its private uid (root). docs/tools.md has the measured guarantees and the tests.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pacs_megatron.envs import isolation
from pacs_megatron.utils.logging import get_logger, warn_once

if TYPE_CHECKING:
    from pacs_megatron.config.tools import ToolsConfig

logger = get_logger(__name__)

LEVELS = ("auto", "bwrap", "rlimits")
KINDS = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "crash", "sandbox_error")
"""How a call ended (:attr:`SandboxResult.kind`)."""
_EXIT_GRACE_S = 0.2
"""After the top process exits, how long its pipes may stay open (a background child holds them) before the
call is ended anyway: the output so far is kept, the child killed."""


class SandboxError(RuntimeError):
    """The sandbox asked for cannot run on this machine; the message names the config field and the fix."""


@dataclass(frozen=True)
class Limits:
    """What one call may use. Per process: CPU, memory; per call: wall time, processes, output."""

    cpu_seconds: float = 10.0
    wall_seconds: float = 20.0
    memory_mb: int = 1024
    max_processes: int = 64
    output_bytes: int = 16384
    """Bytes kept per stream; one more and the call is stopped (``output_limit``)."""
    max_output_chars: int = 4096
    """Characters a tool returns to the model (the tools truncate to it; the sandbox keeps bytes)."""

    @classmethod
    def from_config(cls, cfg: ToolsConfig) -> Limits:
        """The limits ``tools.*`` sets."""
        return cls(
            cfg.cpu_seconds, cfg.wall_seconds, cfg.memory_mb, cfg.max_processes, cfg.output_bytes, cfg.max_output_chars
        )


@dataclass
class SandboxResult:
    """How one call ended, what it printed (decoded, replacement chars for bad UTF-8) and how long it took."""

    kind: str
    stdout: str
    stderr: str
    exit_code: int | None
    """The code's exit status; None when it was killed (``signal`` then says by what, if known)."""
    signal: int | None
    seconds: float

    @property
    def ok(self) -> bool:
        """The code ran to the end and exited 0."""
        return self.kind == "ok"


@functools.cache
def _bwrap_problem(private: bool, interp: isolation.Interpreter) -> str:
    return isolation.bwrap_problem(isolation.find_bwrap(), interp, isolation.private_uid() if private else None)


def _interpreter(key: str) -> isolation.Interpreter:
    interp = isolation.find_interpreter(os.geteuid() == 0)
    if interp is None:
        raise SandboxError(
            f"{key}: no Python here is readable by the sandbox's private uid (the trainer's own is under a private "
            "folder): apt-get install python3, or run the trainer from an interpreter outside a 0700 home"
        )
    return interp


def check_sandbox(level: str | ToolsConfig = "auto", key: str = "tools.sandbox") -> str:
    """The level a call will run at here ("bwrap" or "rlimits"), or :class:`SandboxError` in one line.

    ``level`` is ``tools.sandbox`` (or the whole ToolsConfig); "auto" falls back to rlimits with a warning,
    "bwrap" where bubblewrap cannot start is refused. The bwrap probe (one sandbox start, 0.1-0.3 s) runs once
    per process.
    """
    if not isinstance(level, str):
        level = level.sandbox
    if level not in LEVELS:
        raise SandboxError(f"{key}={level!r} is not valid: choose one of {list(LEVELS)}")
    interp = _interpreter(key)
    if level == "rlimits":
        return "rlimits"
    problem = _bwrap_problem(os.geteuid() == 0, interp)
    if not problem:
        return "bwrap"
    if level == "bwrap":
        raise SandboxError(
            f"{key}=bwrap but bubblewrap cannot start a sandbox here ({problem}): apt-get install bubblewrap "
            f"(it needs unprivileged user namespaces, user.max_user_namespaces > 0), or set {key}=rlimits"
        )
    warn_once(
        logger,
        f"{key}=auto: bubblewrap cannot start here ({problem}); tool code runs with rlimits only "
        "(no network or file-system confinement; docs/tools.md)",
    )
    return "rlimits"


class Sandbox:
    """Runs code at one level with one set of limits; :meth:`run` is safe to call from many threads at once.

    Example:
        >>> sb = Sandbox("auto", Limits(cpu_seconds=2, wall_seconds=5))  # doctest: +SKIP
        >>> sb.run("print(123 * 456)").stdout  # doctest: +SKIP
        '56088\\n'
    """

    def __init__(
        self,
        level: str = "auto",
        limits: Limits | None = None,
        packages: tuple[str, ...] = ("numpy", "sympy", "mpmath"),
        key: str = "tools.sandbox",
    ) -> None:
        self.limits = limits or Limits()
        self.private = os.geteuid() == 0
        self.interp = _interpreter(key)
        self.level = check_sandbox(level, key)
        self.packages = isolation.package_paths(packages, self.private) if self.interp.packages_fit else []
        self.bwrap = isolation.find_bwrap() or "bwrap"  # found by check_sandbox when the level is bwrap

    @classmethod
    def from_config(cls, cfg: ToolsConfig) -> Sandbox:
        """The sandbox ``tools.*`` describes (the level checked here, raising :class:`SandboxError`)."""
        return cls(cfg.sandbox, Limits.from_config(cfg), cfg.packages)

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` as a Python script in a fresh sandboxed process. Never raises: what the code does is the
        result's kind, and a failure of the machine (no temp space, no processes left) is a ``sandbox_error``."""
        t0 = time.monotonic()
        try:
            return self._run(code, t0)
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            logger.warning("tool sandbox: the call could not run: %s: %s", type(e).__name__, e)
            return SandboxResult("sandbox_error", "", f"{type(e).__name__}: {e}", None, None, time.monotonic() - t0)

    def _run(self, code: str, t0: float) -> SandboxResult:
        uid = isolation.private_uid()
        workdir, code_file = isolation.work_dir(code, uid)
        proc: subprocess.Popen[bytes] | None = None
        stopped: str | None = "timeout"  # what _end assumes if the read below raised (KeyboardInterrupt)
        try:
            argv, env = self._command(workdir, code_file)
            ids: dict[str, Any] = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=workdir,
                start_new_session=True,
                close_fds=True,
                **ids,
            )
            out, err, stopped = _collect(proc, t0 + self.limits.wall_seconds, self.limits.output_bytes)
        finally:
            if proc is not None:
                self._end(proc, uid, stopped)
            isolation.remove_tree(workdir)
        rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL  # a wait that timed out in _end
        return self._result(rc, out, err, stopped, time.monotonic() - t0)

    def _command(self, workdir: str, code_file: str) -> tuple[list[str], dict[str, str]]:
        limits = isolation.rlimits(
            self.limits.cpu_seconds, self.limits.memory_mb, self.limits.max_processes, self.private
        )
        if self.level == "bwrap":
            prefix, inner_code, path = isolation.bwrap_argv(
                self.bwrap, self.interp, self.packages, code_file, self.limits.memory_mb
            )
            env = isolation.child_env("/tmp")
        else:
            prefix, inner_code, env = [], code_file, isolation.child_env(workdir)
            path = list(dict.fromkeys(os.path.dirname(p) for p in self.packages))
        cfg = json.dumps({"rlimits": limits, "path": path})
        return [*prefix, self.interp.path, "-I", "-S", "-B", "-c", isolation.BOOTSTRAP, inner_code, cfg], env

    def _end(self, proc: subprocess.Popen[bytes], uid: int | None, stopped: str | None) -> None:
        if stopped is None and proc.returncode is None:  # its pipes closed: it is exiting (bwrap: its namespace)
            try:
                proc.wait(timeout=_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        # Unreaped, the pid cannot have been reused: its group is the call's. Reaped, the group is only killed
        # where nothing else ends stragglers (no private uid, no pid namespace).
        if proc.returncode is None or (uid is None and self.level == "rlimits"):
            isolation.kill_group(proc.pid)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
            logger.warning("tool sandbox: process %d ignored SIGKILL for 10 s", proc.pid)
        if uid is not None:
            isolation.kill_uid(uid, self.interp.path)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    def _result(self, rc: int, out: bytes, err: bytes, stopped: str | None, seconds: float) -> SandboxResult:
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        if stopped is not None:  # we killed it: timeout or output_limit
            return SandboxResult(stopped, stdout, stderr, None, signal.SIGKILL, seconds)
        # bwrap reports a signal as 128 + N, as a shell does (an exit(137) of the code reads the same)
        sig = -rc if rc < 0 else (rc - 128 if self.level == "bwrap" and rc > 128 else None)
        if sig is not None:
            kind = "cpu_limit" if sig == signal.SIGXCPU else "crash"
            return SandboxResult(kind, stdout, stderr, None, sig, seconds)
        if rc == 0:
            return SandboxResult("ok", stdout, stderr, 0, None, seconds)
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        if self.level == "bwrap" and stderr.startswith("bwrap:"):
            logger.warning("tool sandbox: bwrap failed: %s", last)
            kind = "sandbox_error"
        else:
            kind = "memory_limit" if "MemoryError" in last else "error"
        return SandboxResult(kind, stdout, stderr, rc, None, seconds)

    def describe(self) -> str:
        """What this sandbox enforces on this machine and what it does not, one item a line (docs/tools.md)."""
        lim = self.limits
        pkgs = ", ".join(os.path.basename(p) for p in self.packages if not p.endswith(".libs")) or "none"
        who = "a private uid per call (the trainer is root)" if self.private else "the trainer's own uid"
        on = [
            f"one fresh process per call, as {who}; {self.interp.path} -I -S -B (no site-packages)",
            "environment: PATH, LANG, HOME, TMPDIR, one BLAS thread; nothing of the trainer's",
            f"CPU {lim.cpu_seconds:g} s and address space {lim.memory_mb} MiB per process (RLIMIT_CPU, RLIMIT_AS); "
            f"files up to {lim.memory_mb} MiB each, 256 open files, no core dumps",
            f"wall {lim.wall_seconds:g} s per call, then every process of the call is killed",
            f"output: {lim.output_bytes} bytes kept per stream; one more stops the call",
            f"importable besides the standard library: {pkgs} (read-only)",
        ]
        off = ["system calls are not filtered (no seccomp)"]
        if self.private:
            on.append(
                f"at most {lim.max_processes} processes and threads at once (RLIMIT_NPROC of the private uid); at "
                "the end every process of that uid is killed, detached ones included"
            )
            off.append(f"memory and CPU are per process: a call may use {lim.max_processes} x those")
        else:
            off.append(
                "the number of processes (RLIMIT_NPROC would count the trainer's own threads): a fork bomb grows "
                "until the wall limit kills it; memory and CPU are per process"
            )
        if self.level == "bwrap":
            on += [
                "new user, pid, network, mount, ipc and uts namespaces (bubblewrap): network is loopback only; the "
                "host's processes, /proc and the trainer's environment are out of sight",
                f"file system: /usr, the interpreter and the packages read-only; a private {lim.memory_mb} MiB tmpfs "
                "/tmp (cwd, HOME) gone after the call; nothing else of the host (run dir, cwd, /work, homes, /etc)",
            ]
        else:
            on.append("cwd, HOME and TMPDIR: a fresh temp dir (0700), deleted after the call")
            writable = "/tmp, /dev/shm" if self.private else "/tmp and all the trainer's user owns (run dir, outputs)"
            off += [
                "network: NOT blocked (sockets, connections to localhost and beyond work)",
                "file reads: NOT confined beyond file permissions: world-readable files of the host are readable",
                f"file writes: NOT confined beyond file permissions: {writable}",
                "processes: the host's are visible in /proc"
                + ("" if self.private else ", the trainer's environment among them (/proc/PID/environ)"),
            ]
            if not self.private:
                off.append("a process that leaves the call's session (setsid) outlives the call")
        lines = [f"sandbox level: {self.level}"]
        lines += [f"  enforced: {s}" for s in on] + [f"  NOT enforced: {s}" for s in off]
        return "\n".join(lines)


def _collect(proc: subprocess.Popen[bytes], deadline: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """Read both pipes until they close, with at most ``cap`` bytes kept per stream. Returns the bytes and
    "timeout" / "output_limit" when the call must be stopped (never buffers more than ``cap`` + 64 KiB)."""
    assert proc.stdout is not None and proc.stderr is not None
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    exited_at: float | None = None
    stopped: str | None = None
    try:
        while sel.get_map() and stopped is None:
            now = time.monotonic()
            if now >= deadline:
                stopped = "timeout"
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _EXIT_GRACE_S:
                break  # a background child holds the pipes: the call is over, _end kills it
            for key, _ in sel.select(timeout=min(deadline - now, 0.05 if exited_at is not None else 0.25)):
                fd = int(key.fd)
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                room = cap - len(bufs[fd])
                bufs[fd] += chunk[:room]
                if len(chunk) > room:
                    stopped = "output_limit"
    finally:
        sel.close()
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), stopped
