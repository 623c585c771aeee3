"""The call's first process, run as the trainer's user before any of the call's code: it joins the call's
cgroup, and at ``rlimits-trusted`` makes the namespaces, then becomes the call's private uid and runs it.

Why a stage of its own: a process cannot be moved into a cgroup before it runs (Python's ``subprocess`` has no
``CLONE_INTO_CGROUP``), and moving it from outside after ``Popen`` returns races with its first fork; a
process that joins by itself before ``exec`` leaves no window. Why Python: the same interpreter the call runs
(-I -S: ~15 ms), no new dependency (util-linux ``unshare``/``setpriv`` would do the namespace part too).

At ``rlimits-trusted`` (root, no bubblewrap), :data:`STAGE` unshares mount, network, pid, ipc and uts
namespaces; pid 1 of the new pid namespace stays root (the code, a private uid, can neither signal nor
ptrace it), mounts a fresh /proc and a private tmpfs on /tmp, /var/tmp, /dev/shm and /run/lock (the
world-writable places; the code is copied into /tmp), brings ``lo`` up and waits for the call's process;
when that exits, pid 1 exits and the kernel kills whatever the call left. The host's file system is
otherwise the host's, readable where its permissions let any user read (docs/tools.md's table). The packages
the call may import (numpy, sympy) and the interpreter's prefix, where they lie under one of those places (a
venv made in /tmp), are bound back read-only at their own paths over the call's tmpfs: each is opened
(``O_PATH``) before the tmpfs covers it and bound from ``/proc/self/fd`` after, so nothing else of the host's
/tmp shows.
"""

from __future__ import annotations

import json

PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
"""World-writable places on a Debian host that a private uid could write; each gets the call's own tmpfs."""
STATUS_BAD_STAGE = 125
"""Exit status of a stage that could not set the call up (its stderr starts with ``pacs-sandbox:``)."""

STAGE = r"""
import ctypes, fcntl, json, os, signal, socket, struct, sys
def fail(what, err):
    sys.stderr.write(f"pacs-sandbox: {what}: {os.strerror(err) if isinstance(err, int) else err}\n")
    os._exit(125)
def status(st):
    return os.waitstatus_to_exitcode(st) if os.WIFEXITED(st) else 128 + os.WTERMSIG(st)
cfg = json.loads(sys.argv[1])
for procs in cfg["cgroups"]:
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        fail(f"joining the call's cgroup {procs}", e.errno)
libc = ctypes.CDLL(None, use_errno=True)
def drop_and_exec():
    uid = cfg["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binary gives the code root back
    os.chdir(cfg["cwd"])
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
if not cfg["namespaces"]:
    drop_and_exec()
def mount(src, target, fstype, flags, data):
    if libc.mount(src, target.encode(), fstype, flags, data) != 0:
        fail(f"mount {target}", ctypes.get_errno())
with open(cfg["code"], "rb") as f:
    code = f.read()
# CLONE_NEWNS | NEWUTS | NEWIPC | NEWPID | NEWNET
if libc.unshare(0x00020000 | 0x04000000 | 0x08000000 | 0x20000000 | 0x40000000) != 0:
    fail("unshare (namespaces need root's CAP_SYS_ADMIN; a container may withhold it)", ctypes.get_errno())
mount(None, "/", None, 0x4000 | 0x40000, None)  # MS_REC | MS_PRIVATE: nothing mounted here reaches the host
init = os.fork()
if init:
    sys.exit(status(os.waitpid(init, 0)[1]))
libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: the namespace dies with the stage
mount(b"proc", "/proc", b"proc", 0x2 | 0x4 | 0x8, None)  # nosuid, nodev, noexec: this namespace's pids only
keep = []
for path in cfg["keep"]:  # opened here (a bind from the host namespace fails), before the tmpfs covers them
    try:
        keep.append((path, os.open(path, os.O_PATH), os.path.isdir(path)))
    except OSError as e:
        fail(f"opening {path}", e.errno)
for target, size_mb in cfg["tmpfs"]:
    if os.path.isdir(target):
        mount(b"tmpfs", target, b"tmpfs", 0x2 | 0x4, f"size={size_mb}m,mode=1777".encode())
for path, fd, is_dir in keep:  # root's 0755 folders on the way: the private uid reads, never writes
    os.makedirs(path if is_dir else os.path.dirname(path), mode=0o755, exist_ok=True)
    if not is_dir:
        open(path, "wb").close()
    mount(f"/proc/self/fd/{fd}".encode(), path, None, 0x1000 | 0x4000, None)  # MS_BIND | MS_REC
    mount(None, path, None, 0x1000 | 0x20 | 0x1 | 0x2, None)  # MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
    os.close(fd)
with open("/tmp/main.py", "wb") as f:
    f.write(code)
if cfg["uid"] is not None:
    os.chown("/tmp/main.py", cfg["uid"], cfg["uid"])
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # lo up, as bwrap does (SIOCGIFFLAGS, SIOCSIFFLAGS)
    flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
try:
    socket.sethostname("sandbox")
except OSError:  # a container's seccomp profile may refuse it: the name is cosmetic
    pass
worker = os.fork()
if worker == 0:
    drop_and_exec()
while True:  # pid 1 reaps every orphan until the call's own process ends
    pid, st = os.wait()
    if pid == worker:
        os._exit(status(st))
"""


def stage_argv(
    interp: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    uid: int | None,
    cgroups: list[str],
    code: str = "",
    tmp_mb: int = 0,
    keep: list[str] | None = None,
) -> list[str]:
    """The command that runs :data:`STAGE` for one call: join ``cgroups``, become ``uid``, exec ``argv`` with
    ``env`` in ``cwd``; with ``code`` (the host path of main.py), in new namespaces first (rlimits-trusted),
    /tmp and /var/tmp then ``tmp_mb`` MiB each, /dev/shm up to 64 MiB of it, /run/lock 1 MiB, and of the host's
    paths ``keep`` those under them (:func:`under_private_dirs`) bound back read-only."""
    sizes = {"/dev/shm": min(64, tmp_mb), "/run/lock": 1}
    cfg = {
        "cgroups": cgroups,
        "uid": uid,
        "namespaces": bool(code),
        "code": code,
        "tmpfs": [[d, sizes.get(d, tmp_mb)] for d in PRIVATE_DIRS],
        "keep": under_private_dirs(keep or []) if code else [],
        "argv": argv,
        "env": env,
        "cwd": cwd,
    }
    return [interp, "-I", "-S", "-B", "-c", STAGE, json.dumps(cfg)]


def under_private_dirs(paths: list[str]) -> list[str]:
    """Those of ``paths`` (real paths) that a call's private tmpfs would cover, in order, without repeats."""
    covered = [p for p in paths if any(p == d or p.startswith(d + "/") for d in PRIVATE_DIRS)]
    return list(dict.fromkeys(covered))
