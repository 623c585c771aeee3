"""The escape suite of issue 57: every attempt a level must contain, at each level this machine can start.

One launch per level runs the attempts that leave the call alive (files, /proc, environment, network,
writes, mount/unshare/ptrace through ctypes, raising rlimits, a 20 GB allocation, a shell) and prints what
each got; the attempts that end the call (killing the caller, ptrace of the sandbox's pid 1, 4 children of
800 MB) run one call each. After every test the host is clean: no process of a private uid or with the
sandbox's marker, no file of a private uid in /tmp, /var/tmp or /dev/shm. The non-root trainer is a child
run with ``setpriv`` as ``nobody``. What a level leaves open is asserted to work *and* to be in ``describe()``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from _sandbox_helpers import CALM, no_leftovers, skip_unless_level

from pacs_megatron.envs import isolation
from pacs_megatron.envs.sandbox import Limits, Sandbox, SandboxError, check_sandbox

pytestmark = pytest.mark.subprocess
REPO = Path(__file__).resolve().parents[2]
SHARED = ("/tmp", "/var/tmp", "/dev/shm")
NOBODY = 65534


@pytest.fixture(scope="module", params=["bwrap", "rlimits-trusted"])
def level(request):
    return skip_unless_level(request.param)


def _private_files() -> list[str]:
    """Entries of the shared writable places owned by a private uid (a call's work dir excepted: removed by
    the call itself, checked in test_envs_sandbox.py)."""
    found = []
    for d in SHARED:
        for name in os.listdir(d) if os.path.isdir(d) else []:
            try:
                uid = os.lstat(os.path.join(d, name)).st_uid
            except FileNotFoundError:
                continue
            if isolation.PRIVATE_UID_BASE <= uid < isolation.PRIVATE_UID_BASE + isolation.PRIVATE_UID_SPAN:
                if not name.startswith("pacs-tool-"):
                    found.append(os.path.join(d, name))
    return found


@pytest.fixture(autouse=True)
def clean_host():
    before = set(_private_files())
    yield
    no_leftovers()
    assert set(_private_files()) <= before, "a call left files in the host's /tmp, /var/tmp or /dev/shm"


PROBE = """
import ctypes, json, os, resource, socket, subprocess
R, libc, token = {}, ctypes.CDLL(None, use_errno=True), TOKEN
def attempt(name, fn):
    try:
        R[name] = ["ok", fn()]
    except BaseException as e:
        R[name] = [type(e).__name__, str(e)[:80]]
R["uid"] = os.getuid()
attempt("secret_file", lambda: open(SECRET).read())
attempt("repo_file", lambda: "[project]" in open(REPO + "/pyproject.toml").read())
R["env"] = sorted(os.environ)
attempt("parent_environ", lambda: open(f"/proc/{TRAINER}/environ", "rb").read()[:10].decode())
R["pids_visible"] = sum(n.isdigit() for n in os.listdir("/proc"))
attempt("connect_host_port", lambda: socket.create_connection(("127.0.0.1", PORT), timeout=5).close())
R["interfaces"] = [n for _, n in socket.if_nameindex()]
for place in ("/tmp", "/var/tmp", "/dev/shm", CWD, "/usr", REPO):
    attempt("write " + place, lambda: open(os.path.join(place, token), "w").write("x"))
def call(fn, *args):
    if fn(*args) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
attempt("mount", lambda: call(libc.mount, b"tmpfs", b"/tmp", b"tmpfs", 0, None))
attempt("unshare_mount", lambda: call(libc.unshare, 0x00020000))
attempt("ptrace_trainer", lambda: call(libc.ptrace, 16, TRAINER, None, None))
attempt("raise_rlimit", lambda: resource.setrlimit(resource.RLIMIT_AS, (-1, -1)))
attempt("alloc_20gb", lambda: len(bytearray(20 * 2**30)))
attempt("shell", lambda: subprocess.run(["/bin/sh", "-c", "id -u"], capture_output=True, text=True).stdout)
pid = os.fork()
if pid == 0:
    os._exit(0 if libc.unshare(0x10000000) == 0 else 1)
R["unshare_user"] = os.waitpid(pid, 0)[1] == 0
print(json.dumps(R))
"""


def test_the_attempts_a_call_survives_are_contained(level, tmp_path, monkeypatch):
    token = f"pacs-escape-{secrets.token_hex(6)}"
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    secret.chmod(0o644)  # readable by anyone: only the sandbox keeps it out
    monkeypatch.chdir(tmp_path)  # the trainer's cwd: its run dir
    monkeypatch.setenv("PACS_TEST_SECRET", "hunter2")
    sb = Sandbox(level, CALM)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        values = dict(TOKEN=token, SECRET=str(secret), REPO=str(REPO), TRAINER=os.getpid(), CWD=str(tmp_path))
        values["PORT"] = server.getsockname()[1]
        result = sb.run("".join(f"{k} = {v!r}\n" for k, v in values.items()) + PROBE)
    try:
        assert result.kind == "ok", result
        r = json.loads(result.stdout)
        assert isolation.PRIVATE_UID_BASE <= r["uid"] and r["shell"] == ["ok", f"{r['uid']}\n"]  # a shell: as it
        assert r["secret_file"][0] == "FileNotFoundError"  # the host's /tmp is not the call's
        assert set(r["env"]) - {"PWD"} == {"HOME", "LANG", "PATH", "TMPDIR"} | {
            f"{x}_NUM_THREADS" for x in ("OPENBLAS", "OMP", "MKL")
        }
        assert r["parent_environ"][0] == "FileNotFoundError" and r["pids_visible"] <= 4  # own pid namespace
        assert r["connect_host_port"][0] in ("ConnectionRefusedError", "OSError") and r["interfaces"] == ["lo"]
        for place in ("/tmp", "/var/tmp", "/dev/shm"):  # its own tmpfs: written there, gone with the call
            assert r[f"write {place}"][0] == "ok" or place == "/var/tmp" and level == "bwrap", r
            assert not os.path.exists(os.path.join(place, token))
        for place in (str(tmp_path), "/usr", str(REPO)):
            assert r[f"write {place}"][0] != "ok" and not os.path.exists(os.path.join(place, token)), r
        denied = {"PermissionError", "ProcessLookupError", "OSError"}  # EPERM, ESRCH (not in its pid namespace)
        assert {r["mount"][0], r["unshare_mount"][0], r["ptrace_trainer"][0]} <= denied, r
        assert r["raise_rlimit"][0] == "ValueError" and r["alloc_20gb"][0] == "MemoryError"
        described = sb.describe()
        if level == "bwrap":
            assert r["repo_file"][0] == "FileNotFoundError" and not r["unshare_user"]
        else:  # open at this level, and said so
            assert r["repo_file"] == ["ok", True] and "NOT enforced: file reads" in described
            assert r["unshare_user"] and "NOT enforced: user namespaces" in described
    finally:
        for place in (str(tmp_path), *SHARED):
            Path(place, token).unlink(missing_ok=True)


def test_killing_the_caller_reaches_only_the_call(level):
    code = f"import os\nfor pid in (os.getppid(), {os.getpid()}, 1, -1):\n    try:\n        os.kill(pid, 9)\n"
    code += "    except OSError as e:\n        print(pid, type(e).__name__)\n"
    result = Sandbox(level, CALM).run(code)
    assert result.kind in ("ok", "crash"), result  # kill(-1) may reach the code itself, never this process
    assert f"{os.getpid()} ProcessLookupError" in result.stdout or result.kind == "crash"


def test_ptrace_of_the_sandboxs_pid_1_is_contained(level):
    """bwrap's pid 1 runs as the call's uid: attaching stops it and the call ends at the wall limit (harmless:
    counted as a timeout). rlimits-trusted's pid 1 is root's: the attach is refused."""
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.ptrace(16, 1, None, None), ctypes.get_errno())"
    )
    result = Sandbox(level, Limits(**{**CALM.__dict__, "wall_seconds": 4})).run(code)
    if level == "bwrap":
        assert result.kind in ("timeout", "ok"), result
    else:
        assert result.kind == "ok" and result.stdout == "-1 1\n", result  # EPERM


def test_one_memory_cap_per_call(level):
    sb = Sandbox(level, Limits(**{**CALM.__dict__, "memory_mb": 1024, "wall_seconds": 60}))
    if not sb.memory.per_call:
        pytest.skip(f"no per-call memory cap here: {sb.memory.describe()}")
    code = textwrap.dedent(
        """
        import os, time
        kids = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                block = bytearray(800 * 2**20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(2)
                os._exit(0)
            kids.append(pid)
        print(sum(os.waitpid(pid, 0)[1] == 0 for pid in kids))
        """
    )
    result = sb.run(code)
    held = int(result.stdout or 0)
    assert held <= 1, result  # 4 x 800 MB never coexist in 1 GiB: the cgroup's OOM killer or the rlimits stop them
    if result.memory_peak_mb is not None:
        assert result.memory_peak_mb <= 1024 + 1, result.memory_peak_mb
    if sb.memory.cap.startswith("cgroup"):  # its /tmp counts too: 800 MB of files + 400 MB of memory is too much
        code = "open('/tmp/f', 'wb').write(bytes(800 * 2**20))\nb = bytearray(400 * 2**20)\n"
        full = sb.run(code + "b[::4096] = bytes(len(b) // 4096)")  # touch every page
        assert full.kind == "memory_limit" and full.memory_peak_mb <= 1024 + 1, full


NON_ROOT_TRAINER = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from pacs_megatron.envs.sandbox import Limits, Sandbox, SandboxError, check_sandbox
out = {}
try:
    check_sandbox("rlimits-trusted")
except SandboxError as e:
    out["refused"] = str(e)
sb = Sandbox("auto", Limits(wall_seconds=30, max_processes=16))
out["result"] = sb.run(sys.argv[2].replace("TRAINER", str(os.getpid()))).__dict__
time.sleep(0.5)
out["describe"] = sb.describe()
print(json.dumps(out))
"""
ATTACKS = """
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(60)"])
for attempt in ("open(CONFIG, 'a').write('x')", "open('/proc/TRAINER/environ').read()", "os.kill(TRAINER, 9)"):
    try:
        eval(attempt)
        print("ESCAPED", attempt)
    except OSError as e:
        print(type(e).__name__)
os.kill(-1, 9)
"""


def test_a_non_root_trainer_gets_bwrap_and_is_refused_the_weaker_level(tmp_path):
    """A non-root trainer (``nobody`` via setpriv): rlimits-trusted is refused in one line; bwrap contains
    what the old rlimits level let through (killing the trainer, its environ, appending to its 0600 config,
    a setsid survivor) and says that memory is per process where no cgroup is writable."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and util-linux setpriv to become a non-root trainer")
    home = tmp_path / "trainer"
    home.mkdir()
    config = home / "config.yaml"
    config.write_text("token: s3cret\n")
    for p in (home, config):
        os.chown(p, NOBODY, NOBODY)
    home.chmod(0o700)
    config.chmod(0o600)
    tmp_path.chmod(0o755)
    attacks = f"CONFIG = {str(config)!r}\n" + ATTACKS
    argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3", "-I", "-c"]
    env = {"PATH": "/usr/bin:/bin", "PACS_TEST_SECRET": "hunter2", "HOME": str(home)}
    run = subprocess.run(
        [*argv, NON_ROOT_TRAINER, str(REPO), attacks], capture_output=True, text=True, timeout=120, cwd=home, env=env
    )
    if "bubblewrap cannot start" in run.stderr:
        pytest.skip(f"bubblewrap cannot start as a non-root user here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-2000:]  # the trainer lived to print its report
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "refused for a non-root trainer" in out["refused"] and "\n" not in out["refused"]
    assert "ESCAPED" not in out["result"]["stdout"] and out["result"]["stdout"].count("Error") == 3, out["result"]
    assert config.read_text() == "token: s3cret\n"
    assert "NOT enforced: memory NOT capped per call" in out["describe"]
    deadline = time.monotonic() + 10  # the namespace's teardown is asynchronous
    while (left := _processes_of(NOBODY)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left


def _processes_of(uid: int) -> list[str]:
    return [
        f"{p.pid} {' '.join(p.info['cmdline'] or [])[:60]}"
        for p in psutil.process_iter(["uids", "cmdline"])
        if p.info["uids"] and p.info["uids"].real == uid
    ]


def test_auto_without_bubblewrap_refuses_in_one_line_naming_the_fix(monkeypatch):
    from pacs_megatron.envs import sandbox

    monkeypatch.setattr(isolation, "find_bwrap", lambda: None)
    for level in ("auto", "bwrap"):
        with pytest.raises(SandboxError) as e:
            check_sandbox(level)
        msg = str(e.value)
        assert "\n" not in msg and f"tools.sandbox={level} but bubblewrap cannot start" in msg, msg
        assert "bwrap is not on PATH" in msg and "apt-get install bubblewrap" in msg
        assert "tools.sandbox=rlimits-trusted" in msg
    with pytest.raises(SandboxError, match="tools.sandbox=rlimits is renamed tools.sandbox=rlimits-trusted"):
        check_sandbox("rlimits")
    assert sandbox.LEVELS == ("auto", "bwrap", "rlimits-trusted")
