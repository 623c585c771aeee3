"""The OS mechanisms of the sandbox: the bwrap command line, the private uid, the interpreter and packages the
code sees, the rlimits the child sets on itself, and the clean-up that leaves no process behind.

:mod:`.sandbox` runs a call with these; nothing here runs untrusted code itself. Where the trainer is root,
each call runs as a random unused uid (``RLIMIT_NPROC`` does not bind root): its own process count, no file
of the host's, and one identity that ``kill(-1, SIGKILL)`` sent as that uid ends however its processes
detached. bwrap runs as that uid too, so an interpreter under a 0700 home gives way to the system's
(:func:`find_interpreter`). The child sets its rlimits on itself (:data:`BOOTSTRAP`): lowering a hard limit
needs no privilege, and no ``preexec_fn`` runs beside torch's threads. Why each piece: docs/tools.md,
"The sandbox".
"""

from __future__ import annotations

import importlib.util
import math
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

PRIVATE_UID_BASE = 1_500_000_000
"""Private uids are drawn from [BASE, BASE + SPAN): far above any account (Debian allots < 2^16 plus
subordinate ranges of 65536 per user from 100000), below 2^31 where some tools treat ids as signed."""
PRIVATE_UID_SPAN = 500_000_000
PYLIB = "/opt/pylib"
"""Where the allowed packages appear inside bwrap (read-only), on the code's ``sys.path``."""
MARKER = "# pacs-megatron tool sandbox"
"""First line of the bootstrap, hence in every sandboxed process's command line: tests find leftovers by it."""

BOOTSTRAP = (
    MARKER
    + r"""
import builtins, json, resource, sys, traceback
_cfg = json.loads(sys.argv[2])
for _name, _soft, _hard in _cfg["rlimits"]:
    _which = getattr(resource, _name)
    _cur = resource.getrlimit(_which)[1]
    if _cur != resource.RLIM_INFINITY:  # never above the hard limit we were given (raising it is refused)
        _soft, _hard = min(_soft, _cur), min(_hard, _cur)
    resource.setrlimit(_which, (_soft, _hard))
sys.path.extend(_cfg["path"])
_path = sys.argv[1]
sys.argv = ["main.py"]
builtins.exit = builtins.quit = sys.exit  # -S skips site, which defines them; models call exit()
with open(_path, encoding="utf-8") as _f:
    _src = _f.read()
_g = {"__name__": "__main__", "__builtins__": builtins, "__file__": "main.py"}
try:
    exec(compile(_src, "main.py", "exec"), _g)
except SystemExit:
    raise
except BaseException as _e:  # the user's traceback without this bootstrap's frame
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
"""
)


@dataclass(frozen=True)
class Interpreter:
    """The Python the sandbox runs: its executable, the prefix to expose, and whether packages fit it."""

    path: str
    prefix: str
    packages_fit: bool
    """Its X.Y version is the trainer's, so the trainer's compiled packages (numpy) import in it."""


def private_uid() -> int | None:
    """A fresh private uid for one call when this process is root (see the module's docstring), else None."""
    if os.geteuid() != 0:
        return None
    return PRIVATE_UID_BASE + secrets.randbelow(PRIVATE_UID_SPAN)


def world_reachable(path: str, execute: bool = False) -> bool:
    """Whether a uid that owns nothing and is in no group may read ``path`` (and run it, with ``execute``)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
        folder = os.path.dirname(real)
        while True:  # every folder on the way must let others through
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
            if folder == os.path.dirname(folder):
                break
            folder = os.path.dirname(folder)
    except OSError:
        return False
    need = stat.S_IROTH | (stat.S_IXOTH if execute or stat.S_ISDIR(st.st_mode) else 0)
    return st.st_mode & need == need


def find_interpreter(private: bool) -> Interpreter | None:
    """The trainer's own interpreter (its base install, not the venv: no site-packages), or where a private
    uid cannot read it, the system's python3 of any version; None if the uid can read no Python at all."""
    own = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    stdlib_os = os.path.join(sysconfig.get_paths()["stdlib"], "os.py")
    if not private or (world_reachable(own, execute=True) and world_reachable(stdlib_os)):
        return Interpreter(own, prefix, True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if candidate and world_reachable(candidate, execute=True):
            real = os.path.realpath(candidate)
            return Interpreter(real, os.path.dirname(os.path.dirname(real)), os.path.basename(real) == version)
    return None


def package_paths(names: tuple[str, ...], private: bool) -> list[str]:
    """Host paths of the importable packages ``names`` (package dir or module file, plus a wheel's ``NAME.libs``
    of bundled shared libraries); missing packages and, for a private uid, unreadable ones are skipped."""
    paths: list[str] = []
    for name in names:
        spec = importlib.util.find_spec(name)  # a top-level name: found without importing it
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or [])
        path = locations[0] if locations else spec.origin
        if not path or not os.path.exists(path) or (private and not world_reachable(path)):
            continue
        paths.append(os.path.realpath(path))
        libs = os.path.join(os.path.dirname(path), f"{name}.libs")
        if os.path.isdir(libs):
            paths.append(os.path.realpath(libs))
    return paths


def rlimits(
    cpu_seconds: float, memory_mb: int, max_processes: int, private: bool, file_mb: int | None = None
) -> list[tuple[str, int, int]]:
    """``(name, soft, hard)`` the child sets on itself: ``memory_mb`` of address space per process, files up
    to ``file_mb`` (default ``memory_mb``) each. The CPU hard limit is one second past the soft one: SIGXCPU
    first (a clean "CPU limit" status), SIGKILL if the code catches it."""
    cpu = max(1, math.ceil(cpu_seconds))
    memory = memory_mb << 20
    files = (file_mb or memory_mb) << 20
    limits = [
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", memory, memory),
        ("RLIMIT_FSIZE", files, files),  # one file at most the size of the sandbox's /tmp
        ("RLIMIT_NOFILE", 256, 256),
        ("RLIMIT_CORE", 0, 0),
    ]
    if private and max_processes:  # root is exempt, and a shared uid's count would include the trainer's threads
        limits.append(("RLIMIT_NPROC", max_processes, max_processes))
    return limits


def _system_dirs() -> list[str]:
    """/usr read-only, and /bin, /lib, ... as the host has them: symlinks into /usr (merged /usr) or binds."""
    args = ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    # the loader's cache and the time zone: nothing secret, and without them some libraries look further
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", f, f]
    return args


def bwrap_argv(
    bwrap: str, interp: Interpreter, packages: list[str], code_file: str, tmp_mb: int
) -> tuple[list[str], str, list[str]]:
    """The bwrap command up to (not including) the interpreter, the code's path inside, and its extra sys.path.

    Every namespace is new (net: loopback only; pid: the call's processes die with it); the root is bwrap's
    tmpfs remounted read-only; writable are only a private /tmp of ``tmp_mb`` MiB (cwd and HOME) and a small
    /dev/shm, both gone when the call ends.
    """
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session"]
    # no --hostname: a container's seccomp profile refuses sethostname even in bwrap's own uts namespace
    # (podman 4.3: "Can't set hostname to sandbox: Operation not permitted"), and bwrap then starts nothing
    args += ["--cap-drop", "ALL", *_system_dirs()]
    if not (interp.prefix == "/usr" or interp.prefix.startswith("/usr/")):
        args += ["--ro-bind", interp.prefix, interp.prefix]
    for path in packages:
        args += ["--ro-bind", path, f"{PYLIB}/{os.path.basename(path)}"]
    args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    args += ["--size", str(min(tmp_mb, 64) << 20), "--tmpfs", "/dev/shm"]
    args += ["--size", str(tmp_mb << 20), "--tmpfs", "/tmp", "--ro-bind", code_file, "/tmp/main.py"]
    args += ["--chdir", "/tmp", "--remount-ro", "/"]
    return args, "/tmp/main.py", [PYLIB] if packages else []


def child_env(home: str) -> dict[str, str]:
    """The child's whole environment: nothing of the trainer's (tokens, paths, ``RAY_ADDRESS``...)."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": home,
        "TMPDIR": home,
        # one BLAS/OpenMP thread: the call is limited per process, and threads count as processes
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def find_bwrap() -> str | None:
    """bubblewrap's path (PATH first: a trainer's PATH may lack /usr/bin), None where it is not installed."""
    return shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin")


def work_dir(code: str, uid: int | None) -> tuple[str, str]:
    """A fresh 0700 folder holding ``code`` as main.py, owned by the call's private uid if any: bwrap binds the
    file from it, the rlimits-trusted stage copies it. Under the system's temp dir, or /tmp where a private uid could
    not reach that (a TMPDIR inside a 0700 home). Returns the folder and the file."""
    root = tempfile.gettempdir()
    if uid is not None and not world_reachable(root):
        root = "/tmp"
    folder = tempfile.mkdtemp(prefix="pacs-tool-", dir=root)
    code_file = os.path.join(folder, "main.py")
    with open(code_file, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code)
    if uid is not None:
        os.chown(folder, uid, uid)
        os.chown(code_file, uid, uid)
    return folder, code_file


_KILL = shutil.which("kill", path="/usr/bin:/bin")
"""procps' or util-linux's kill (a few ms); the interpreter does it where neither is installed."""


def kill_uid(uid: int, interp: str) -> None:
    """SIGKILL every process of ``uid``, detached ones included: ``kill(-1)`` sent as that uid reaches all it
    may signal, which is exactly its own. One pass is enough: the kernel walks the processes under the lock a
    fork takes, and a fork whose parent already has SIGKILL pending is aborted."""
    cmd = [_KILL, "-KILL", "-1"] if _KILL else [interp, "-I", "-S", "-c", "import os; os.kill(-1, 9)"]
    try:
        subprocess.run(
            cmd,
            user=uid,
            group=uid,
            extra_groups=[],
            env={},
            cwd="/",
            timeout=30,
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as e:  # pragma: no cover - /usr is read-only to us too
        raise RuntimeError(f"could not kill the processes of private uid {uid}: {e}") from e


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (the call's top process was started in its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove_tree(path: str) -> None:
    """Delete ``path`` even where the code made a directory unreadable (a same-uid ``chmod 000``)."""

    def fix(func: object, p: str, exc: object) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        except OSError:
            pass

    # onexc from Python 3.12 (onerror is deprecated there), onerror before; both hand (func, path, error)
    hook = {"onexc": fix} if sys.version_info >= (3, 12) else {"onerror": fix}
    for _ in range(3):
        shutil.rmtree(path, **hook)  # type: ignore[arg-type]
        if not os.path.lexists(path):
            return
