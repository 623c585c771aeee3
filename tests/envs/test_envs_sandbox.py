"""The tool sandbox's limits at each level (issues 45, 57): a computation runs and leaves nothing, and a fork
bomb, output without end, an endless loop, a sleep, a memory blow-up and a detached background child each end
the call as its kind says, with no process left. The escape attempts are in test_envs_escapes.py.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time

import pytest
from _sandbox_helpers import CALM, no_leftovers, skip_unless_level

from pacs_megatron.envs import isolation
from pacs_megatron.envs.sandbox import Limits, Sandbox

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module", params=["bwrap", "rlimits-trusted"])
def level(request):
    return skip_unless_level(request.param)


def _sandbox(level: str, **limits) -> Sandbox:
    return Sandbox(level, Limits(**{**CALM.__dict__, **limits}))


def test_a_computation_runs_and_its_temp_dir_is_removed(level):
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "pacs-tool-*")))
    result = _sandbox(level).run("import os\nprint(123 * 456)\nprint(os.getcwd())")
    assert result.kind == "ok" and result.exit_code == 0, result
    out, cwd = result.stdout.split()
    assert out == "56088"
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "pacs-tool-*"))) <= before  # removed after the call
    assert cwd == "/tmp"  # the call's own tmpfs at both levels
    # a traceback without the bootstrap's frame, and the standard library
    bad = _sandbox(level).run("import json\nprint(json.dumps([1]))\n1/0")
    assert bad.kind == "error" and bad.stdout == "[1]\n" and bad.exit_code == 1
    assert bad.stderr.splitlines()[-1] == "ZeroDivisionError: division by zero" and "main.py" in bad.stderr
    assert "json.loads(sys.argv" not in bad.stderr


def test_a_fork_bomb_ends_at_the_wall_limit_and_leaves_nothing(level):
    code = (
        "import os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
        "    except OSError:\n        time.sleep(0.001)"
    )
    t0 = time.monotonic()
    result = _sandbox(level, wall_seconds=3, max_processes=16).run(code)
    assert result.kind == "timeout", result
    assert time.monotonic() - t0 < 3 + 10  # the kill and clean-up take seconds at most, never the bomb's life
    no_leftovers()


def test_output_without_end_is_capped(level):
    t0 = time.monotonic()
    result = _sandbox(level).run("while True:\n    print('x' * 1000)")
    assert result.kind == "output_limit", result
    assert len(result.stdout.encode()) <= CALM.output_bytes
    assert time.monotonic() - t0 < 30


def test_an_endless_loop_hits_the_cpu_limit_and_a_sleep_the_wall_limit(level):
    spin = _sandbox(level, cpu_seconds=1).run("while True:\n    pass")
    assert spin.kind == "cpu_limit" and spin.signal == 24, spin  # SIGXCPU
    t0 = time.monotonic()
    sleep = _sandbox(level, wall_seconds=2).run("import time\ntime.sleep(100)")
    assert sleep.kind == "timeout" and sleep.exit_code is None, sleep
    assert 2 <= time.monotonic() - t0 < 12
    no_leftovers()


def test_a_memory_blow_up_is_stopped(level):
    result = _sandbox(level, memory_mb=256).run("x = []\nwhile True:\n    x.append(bytearray(10**7))")
    assert result.kind == "memory_limit", result
    assert result.stderr.strip().splitlines()[-1] == "MemoryError"


def test_numpy_and_sympy_import_where_installed(level):
    pytest.importorskip("numpy")
    pytest.importorskip("sympy")
    result = _sandbox(level).run("import numpy, sympy\nprint(int(numpy.arange(5).sum()), sympy.factor('x**2 - 1'))")
    assert result.stdout == "10 (x - 1)*(x + 1)\n", result


def test_a_package_under_tmp_imports_at_both_levels(level, monkeypatch):
    """A trainer whose venv lies under /tmp (a CI scratch, a container's): at rlimits-trusted the call's private
    /tmp covered the host's, so numpy and sympy were gone from the call without a word (found in issue 59: the
    fast tier failed in a venv made in /tmp). The call sees such a package at its own path, read-only."""
    site = tempfile.mkdtemp(prefix="pacs-site-", dir="/tmp")
    try:
        os.chmod(site, 0o755)  # a private uid must reach it, as a venv's site-packages
        pkg = os.path.join(site, "pacs_probe_pkg")
        os.mkdir(pkg)
        os.chmod(pkg, 0o755)
        with open(os.path.join(pkg, "__init__.py"), "w") as f:
            f.write("VALUE = 7\n")
        os.chmod(os.path.join(pkg, "__init__.py"), 0o644)
        monkeypatch.syspath_prepend(site)
        sandbox = Sandbox(level, Limits(**CALM.__dict__), packages=("pacs_probe_pkg",))
        assert sandbox.packages == [os.path.realpath(pkg)]
        result = sandbox.run("import os, pacs_probe_pkg\nprint(pacs_probe_pkg.VALUE, os.listdir('/tmp'))")
        assert result.kind == "ok", result
        value, listing = result.stdout.split(" ", 1)
        assert value == "7"
        # the call's /tmp is still its own: the package's folders, its code, nothing else of the host's /tmp
        assert "pytest-of-root" not in listing
    finally:
        import shutil

        shutil.rmtree(site)


def test_a_background_child_neither_holds_the_call_nor_survives_it(level):
    code = (
        "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(60)'])\nprint('done')"
    )
    result = _sandbox(level, wall_seconds=30).run(code)
    assert result.kind == "ok" and result.stdout == "done\n", result
    assert result.seconds < 15  # not the wall limit: the call ends with its top process
    no_leftovers()


def test_a_machine_failure_is_a_result_not_an_exception(level, monkeypatch):
    from pacs_megatron.envs.python_tool import run_python

    sandbox = _sandbox(level)

    def no_space(code, uid):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(isolation, "work_dir", no_space)
    result = sandbox.run("print(1)")
    assert result.kind == "sandbox_error" and "No space left" in result.stderr
    assert run_python("print(1)", sandbox).text == "[error: the sandbox could not run the code]\n"


def test_bwraps_command_sets_no_hostname():
    """Fails on the old code: ``--hostname`` makes bwrap call sethostname, which a container's seccomp profile
    refuses even in bwrap's own uts namespace (podman 4.3: "Can't set hostname to sandbox: Operation not
    permitted"), so no call could start in the CPU image."""
    interp = isolation.Interpreter("/usr/bin/python3", "/usr", True)
    args, inner, _ = isolation.bwrap_argv("bwrap", interp, [], "/tmp/x/main.py", 64)
    assert "--hostname" not in args and "--unshare-all" in args and inner == "/tmp/main.py"
