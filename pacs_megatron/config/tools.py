"""Tool settings of tool-integrated rollouts: which tools the policy may call and the sandbox they run in.

The tools themselves, their sandbox and the pool that runs them live in ``pacs_megatron/envs/``
(docs/tools.md). Checks that need the machine (does bubblewrap start here?) are not made here:
``pacs_megatron.envs.sandbox.check_sandbox`` makes them, from preflight, in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pacs_megatron.config.base import ConfigError, _choice, _positive

_TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TOOL_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def tool_name(spec: str) -> str:
    """The name the model calls ``spec`` by: a built-in's name, or a user function's own name.

    Example:
        >>> tool_name("python"), tool_name("my_pkg.tools:search")
        ('python', 'search')
    """
    return spec.rpartition(":")[2].rpartition(".")[2]


@dataclass
class ToolsConfig:
    """The tools a rollout may call, and the limits of every call of untrusted code."""

    enabled: tuple[str, ...] = ("python",)
    """Tools the model may call: built-in names ("python": run a Python snippet in the sandbox) or
    "package.module:function" specs of your own tools (the model calls those by the function's name;
    envs/registry.py gives the signature). Empty: no tools."""
    sandbox: str = "auto"
    """How untrusted code is confined. "auto" or "bwrap": bubblewrap (fresh pid/net/mount/user namespaces, only
    /usr, the interpreter and ``packages`` visible read-only); where it cannot start, the run stops before any
    model loads, naming the install. "rlimits-trusted": no bubblewrap, for code you trust: root only, new
    network/mount/pid namespaces and a private /tmp, but the host's readable files stay readable; never chosen
    unless named. docs/tools.md says what each level enforces."""
    cpu_seconds: float = 10.0
    """CPU seconds per process of a call (RLIMIT_CPU; the process is killed past it)."""
    wall_seconds: float = 20.0
    """Wall-clock seconds per call, start-up included: then the call and everything it started is killed."""
    memory_mb: int = 1024
    """Memory of one call, in MiB, its processes and its /tmp together: a cgroup's memory.max where one can be
    made (root, or a delegated subtree), else processes x address space (RLIMIT_AS) held within it."""
    max_output_chars: int = 4096
    """Most characters of output a call returns to the model (a marker says what was cut); a call that
    prints far more (4 bytes per char, at least 16 KiB, per stream) is stopped there."""
    max_processes: int = 64
    """Most processes (threads count) a call may run at once, fork bombs included: the call's cgroup's pids.max
    and, as root, RLIMIT_NPROC of its private uid (fewer where no cgroup holds memory_mb: envs/cgroup.py)."""
    packages: tuple[str, ...] = ("numpy", "sympy", "mpmath")
    """Importable packages of the trainer's environment the code may import besides the standard library,
    bound read-only (bwrap) where installed; missing ones are skipped."""
    workers: int = 4
    """Tool calls run at once (local: threads, each waiting on one sandbox process; ray: tasks in flight)."""
    backend: str = "local"
    """"local" (a thread pool on this machine) or "ray" (Ray tasks spread over the cluster's CPUs)."""

    def __post_init__(self) -> None:
        # YAML and OmegaConf hand lists; a tuple keeps the config hashable and unchanged by accident
        self.enabled = tuple(self.enabled)
        self.packages = tuple(self.packages)
        if self.sandbox == "rlimits":  # renamed, not mapped: envs/levels.py says why
            raise ConfigError(
                "tools.sandbox=rlimits is renamed tools.sandbox=rlimits-trusted (for code you trust: the host's "
                "readable files stay readable; root only): set that, or apt-get install bubblewrap and use auto"
            )
        _choice("tools.sandbox", self.sandbox, ("auto", "bwrap", "rlimits-trusted"))
        _choice("tools.backend", self.backend, ("local", "ray"))
        _positive("tools.cpu_seconds", self.cpu_seconds)
        _positive("tools.wall_seconds", self.wall_seconds)
        _positive("tools.memory_mb", self.memory_mb)
        _positive("tools.max_output_chars", self.max_output_chars)
        _positive("tools.max_processes", self.max_processes)
        _positive("tools.workers", self.workers)
        if self.memory_mb < 64:
            raise ConfigError(f"tools.memory_mb={self.memory_mb} is too small to start Python: use 64 or more")
        if self.max_processes < 4:
            raise ConfigError(f"tools.max_processes={self.max_processes} leaves no room for the sandbox: use 4 or more")
        for name in self.enabled:
            if not isinstance(name, str) or not (_TOOL_NAME.match(name) or _TOOL_SPEC.match(name)):
                raise ConfigError(
                    f"tools.enabled has {name!r}: give a built-in tool name (e.g. 'python') "
                    "or 'package.module:function'"
                )
        if len(set(self.enabled)) != len(self.enabled):
            raise ConfigError(f"tools.enabled={list(self.enabled)} names a tool twice")
        for name in self.packages:
            if not isinstance(name, str) or not _TOOL_NAME.match(name):
                raise ConfigError(f"tools.packages has {name!r}: give top-level package names, e.g. 'numpy'")

    @property
    def names(self) -> tuple[str, ...]:
        """The names the model calls the enabled tools by (what a dataset row's ``tools`` list names)."""
        return tuple(tool_name(spec) for spec in self.enabled)

    @property
    def output_bytes(self) -> int:
        """Bytes read per stream of a call before it is stopped (UTF-8 takes up to 4 bytes a char)."""
        return max(4 * self.max_output_chars, 16384)
