"""Run untrusted code (the policy's tool calls) in a fresh, limited process per call.

A call never raises into the trainer and never outlives its wall limit::

    Sandbox(level).run(code) -> SandboxResult(kind, stdout, stderr, exit_code, signal, seconds, memory_peak_mb)
        kind: "ok" | "error" (non-zero exit, a traceback) | "timeout" (wall limit) | "cpu_limit" |
              "memory_limit" | "output_limit" (stopped at the byte cap) | "crash" (a signal) | "sandbox_error"

Two levels (envs/levels.py says what each leaves open), chosen by ``tools.sandbox`` and checked once by
:func:`check_sandbox` (preflight): ``bwrap`` (``auto``: bubblewrap's namespaces, only /usr, the interpreter and
the packages visible) and ``rlimits-trusted`` (root only, set explicitly: new namespaces and a private /tmp,
the host's files readable by permission). Either level: rlimits, a clean environment, a private uid where the
trainer is root, one memory and process cap per call (envs/cgroup.py), output read with a byte cap, and every
process of the call killed at the end. The measured table and the tests: docs/tools.md, "The sandbox".
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

from pacs_megatron.envs import cgroup, enter, isolation, levels
from pacs_megatron.utils.logging import get_logger, warn_once

if TYPE_CHECKING:
    from pacs_megatron.config.tools import ToolsConfig

logger = get_logger(__name__)

LEVELS = levels.LEVELS
KINDS = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "crash", "sandbox_error")
"""How a call ended (:attr:`SandboxResult.kind`)."""
_EXIT_GRACE_S = 0.2
"""After the top process exits, how long its pipes may stay open (a background child holds them) before the
call is ended anyway: the output so far is kept, the child killed."""


class SandboxError(RuntimeError):
    """The sandbox asked for cannot run on this machine; the message names the config field and the fix."""


@dataclass(frozen=True)
class Limits:
    """What one call may use. Per process: CPU; per call: memory, processes, wall time, output."""

    cpu_seconds: float = 10.0
    wall_seconds: float = 20.0
    memory_mb: int = 1024
    """The call's memory, its /tmp included: one cgroup, or split into processes (cgroup.memory_plan)."""
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
    memory_peak_mb: float | None = None
    """The call's highest memory use, where a cgroup held it."""

    @property
    def ok(self) -> bool:
        """The code ran to the end and exited 0."""
        return self.kind == "ok"


def _interpreter(key: str) -> isolation.Interpreter:
    interp = isolation.find_interpreter(os.geteuid() == 0)
    if interp is None:
        raise SandboxError(
            f"{key}: no Python here is readable by the sandbox's private uid (the trainer's own is under a private "
            "folder): apt-get install python3, or run the trainer from an interpreter outside a 0700 home"
        )
    return interp


@functools.cache
def _level_problem(level: str, bwrap: str) -> str:
    """ "" when one call at ``level`` runs here exactly as a tool call will (same stage, uid, cgroup, binds),
    else why not (one line). One sandbox start (0.1-0.3 s), once per process and level."""
    probe = Sandbox(level, Limits(wall_seconds=30, memory_mb=256, max_processes=8), packages=(), _checked=True)
    result = probe.run("print('ok')")
    if result.ok and result.stdout == "ok\n":
        return ""
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1] if lines else f"{result.kind}, exit status {result.exit_code}"


def check_sandbox(level: str | ToolsConfig = "auto", key: str = "tools.sandbox") -> str:
    """The level a call will run at here ("bwrap" or "rlimits-trusted"), or :class:`SandboxError` in one line.

    ``auto`` and ``bwrap`` are bubblewrap or a refusal naming the install and the weaker level's setting;
    ``rlimits-trusted`` is refused for a non-root trainer and where namespaces cannot be made. Never a
    fallback: a weaker level runs only where it is asked for by name.
    """
    if not isinstance(level, str):
        level = level.sandbox
    levels.check_name(level, key, SandboxError)
    _interpreter(key)
    if level == "rlimits-trusted":
        if os.geteuid() != 0:
            raise SandboxError(levels.non_root_refusal(key, os.geteuid()))
        problem = _level_problem(level, "")
        if problem:
            raise SandboxError(
                f"{key}=rlimits-trusted cannot start here ({problem}): install bubblewrap (apt-get install "
                f"bubblewrap) and use {key}=auto, or run the trainer where root may unshare namespaces"
            )
        return level
    bwrap = isolation.find_bwrap()
    problem = "bwrap is not on PATH" if bwrap is None else _level_problem("bwrap", bwrap)
    if problem:
        raise SandboxError(levels.bwrap_refusal(key, level, problem))
    return "bwrap"


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
        *,
        _checked: bool = False,
    ) -> None:
        self.limits = limits or Limits()
        self.private = os.geteuid() == 0
        self.interp = _interpreter(key)
        self.level = level if _checked else check_sandbox(level, key)
        self.packages = isolation.package_paths(packages, self.private) if self.interp.packages_fit else []
        self.bwrap = isolation.find_bwrap() or "bwrap"  # found by check_sandbox when the level is bwrap
        self.hierarchy = cgroup.find_hierarchy()
        self.memory = cgroup.memory_plan(self.limits.memory_mb, self.limits.max_processes, self.private, self.hierarchy)
        if not _checked and (self.level != "bwrap" or not self.memory.per_call):
            open_ = "; ".join(levels.not_enforced(self))
            warn_once(logger, f"tool sandbox at level {self.level}: NOT enforced here: {open_}")

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
        group: cgroup.CallGroup | None = None
        proc: subprocess.Popen[bytes] | None = None
        stopped: str | None = "timeout"  # what _end assumes if the read below raised (KeyboardInterrupt)
        oom, peak = 0, None
        try:
            if isinstance(self.hierarchy, cgroup.Hierarchy):
                group = self.hierarchy.create(self.memory.call_mb, self.memory.processes + cgroup.SANDBOX_TASKS)
            argv, env = self._command(code_file, uid, group)
            # the stage (envs/enter.py) starts as the trainer's user and becomes the private uid itself
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=workdir,
                start_new_session=True,
                close_fds=True,
            )
            out, err, stopped = _collect(proc, t0 + self.limits.wall_seconds, self.limits.output_bytes)
        finally:
            if proc is not None:
                self._end(proc, uid, stopped, group)
            if group is not None:
                oom, peak = group.oom_kills(), group.peak_mb()
                group.remove()
            isolation.remove_tree(workdir)
        rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL  # a wait that timed out in _end
        result = self._result(rc, out, err, stopped, time.monotonic() - t0)
        result.memory_peak_mb = peak
        if oom and not result.ok and result.kind != "output_limit":  # the cgroup's OOM killer ended a process
            result.kind = "memory_limit"
        return result

    def _command(self, code_file: str, uid: int | None, group: cgroup.CallGroup | None) -> tuple[list[str], dict]:
        """The call's command and environment: the stage (envs/enter.py) in front where the call joins a cgroup,
        becomes a private uid or gets namespaces; bwrap alone for a non-root trainer without a cgroup."""
        plan = self.memory
        nproc = plan.processes + (2 if self.level == "bwrap" and plan.cap == "rlimits" else 0)  # bwrap's own two
        limits = isolation.rlimits(self.limits.cpu_seconds, plan.process_mb, nproc, self.private, plan.tmp_mb)
        env = isolation.child_env("/tmp")
        if self.level == "bwrap":
            prefix, inner_code, path = isolation.bwrap_argv(
                self.bwrap, self.interp, self.packages, code_file, plan.tmp_mb
            )
        else:  # rlimits-trusted: the stage copies the code into the call's own /tmp
            prefix, inner_code = [], "/tmp/main.py"
            path = list(dict.fromkeys(os.path.dirname(p) for p in self.packages))
        cfg = json.dumps({"rlimits": limits, "path": path})
        argv = [*prefix, self.interp.path, "-I", "-S", "-B", "-c", isolation.BOOTSTRAP, inner_code, cfg]
        if self.level == "bwrap" and uid is None and group is None:
            return argv, env
        procs = group.procs_files if group is not None else []
        namespaced = self.level == "rlimits-trusted"
        cwd = "/tmp" if namespaced else os.path.dirname(code_file)
        code = code_file if namespaced else ""
        keep = [*self.packages, self.interp.prefix]  # what the call imports must outlive its private /tmp
        return enter.stage_argv(self.interp.path, argv, env, cwd, uid, procs, code, plan.tmp_mb, keep), env

    def _end(
        self, proc: subprocess.Popen[bytes], uid: int | None, stopped: str | None, group: cgroup.CallGroup | None
    ) -> None:
        if stopped is None and proc.returncode is None:  # its pipes closed: it is exiting (its namespace too)
            try:
                proc.wait(timeout=_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        # Unreaped, the pid cannot have been reused: its group is the call's. Reaped, its namespaces (pid 1's
        # exit), the cgroup and the private uid end whatever it left.
        if proc.returncode is None:
            isolation.kill_group(proc.pid)
        if group is not None:
            group.kill()
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
        # bwrap and the stage's pid 1 report a signal as 128 + N, as a shell does (an exit(137) reads the same)
        sig = -rc if rc < 0 else (rc - 128 if rc > 128 else None)
        if sig is not None:
            kind = "cpu_limit" if sig == signal.SIGXCPU else "crash"
            return SandboxResult(kind, stdout, stderr, None, sig, seconds)
        if rc == 0:
            return SandboxResult("ok", stdout, stderr, 0, None, seconds)
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        if stderr.startswith(("bwrap:", "pacs-sandbox:")):
            logger.warning("tool sandbox: the sandbox failed: %s", last)
            kind = "sandbox_error"
        else:
            kind = "memory_limit" if "MemoryError" in last else "error"
        return SandboxResult(kind, stdout, stderr, rc, None, seconds)

    def describe(self) -> str:
        """What this sandbox enforces on this machine and what it does not, one item a line (docs/tools.md)."""
        return levels.describe(self)

    def record(self) -> dict[str, Any]:
        """The level and its limits as the run's summary and eval's output record them (levels.record)."""
        return levels.record(self)


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
