"""A process's entry point exits without the interpreter's teardown (utils/proc.py's run_main)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import atexit, sys
from pacs_megatron.utils.proc import run_main
class Cycle:  # kept alive by a cycle: the interpreter's last collection would finalise it
    def __del__(self):
        print("teardown ran", flush=True)
c = Cycle(); c.me = c; del c
def main():
    import logging
    atexit.register(lambda: print("library handler", flush=True))  # registered after run_main's: runs first
    logging.basicConfig(filename=sys.argv[2], level=logging.INFO)
    logging.getLogger("x").info("logged")
    print("main done")  # stdout is a pipe: block-buffered until flushed
    return {"0": 0, "3": 3, "None": None, "text": "a message"}[sys.argv[1]]
run_main(main)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("code, rc", [("0", 0), ("3", 3), ("None", 0), ("text", 1)])
def test_run_main_exits_with_the_code_after_the_handlers_without_teardown(tmp_path, code, rc):
    """Old code: ``sys.exit(main())``, and the interpreter's teardown swept the heap (2-4 s a rank, py-spy)."""
    log = tmp_path / "log"
    out = subprocess.run([sys.executable, "-c", CHILD, code, str(log)], capture_output=True, text=True, timeout=60)
    assert out.returncode == rc, out.stderr
    assert out.stdout.splitlines() == ["main done", "library handler"]  # flushed; no teardown finaliser
    assert "logged" in log.read_text()  # logging shut down (flushed) before os._exit
    assert ("a message" in out.stderr) == (code == "text")


@pytest.mark.subprocess
def test_a_raising_main_exits_as_usual():
    child = "from pacs_megatron.utils.proc import run_main\ndef main():\n    raise KeyError('boom')\nrun_main(main)\n"
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "KeyError: 'boom'" in out.stderr


def test_the_entry_points_run_through_it():
    import tomllib  # 3.11+: imported here so that collection works on 3.10

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pacs-megatron"] == "pacs_megatron.cli:script"
    for module in ("pacs_megatron/__main__.py", "pacs_megatron/launch/__main__.py"):
        assert "run_main(" in (REPO / module).read_text(), module


MP_CHILD = """
import multiprocessing.connection, sys, time  # as the engine and the reward worker do: this registers
# multiprocessing's atexit handler (multiprocessing.util) before run_main registers its own
import multiprocessing
from pathlib import Path
from pacs_megatron.utils.proc import run_main
def late(path):
    time.sleep(1.0)
    Path(path).write_text("done")
def main():
    ctx = multiprocessing.get_context("spawn")
    ctx.Process(target=late, args=(sys.argv[1],)).start()  # joined at exit by multiprocessing
    daemon = ctx.Process(target=time.sleep, args=(120,), daemon=True)  # terminated at exit by multiprocessing
    daemon.start()
    Path(sys.argv[2]).write_text(str(daemon.pid))
    return 0
if __name__ == "__main__":
    run_main(main)
"""


@pytest.mark.subprocess
def test_run_main_keeps_multiprocessings_exit_when_it_was_imported_first(tmp_path):
    """The engine process and the reward worker import multiprocessing before their entry point runs. Old
    code: run_main's os._exit ran before multiprocessing's handler, so the non-daemon child was not joined
    (its file appeared a second after the exit) and the daemonic one outlived its parent."""
    import psutil
    from _runs import gone_within

    script, done, pid, log = tmp_path / "child.py", tmp_path / "done", tmp_path / "pid", tmp_path / "log"
    script.write_text(MP_CHILD)
    try:
        with log.open("w") as fh:  # a file, not a pipe: a child left running must not hold the run open
            code = subprocess.run([sys.executable, str(script), str(done), str(pid)], stdout=fh, stderr=fh, timeout=60)
        assert code.returncode == 0, log.read_text()
        assert done.is_file() and done.read_text() == "done", "the non-daemon child was not joined"
        assert gone_within(int(pid.read_text()), 10), "the daemonic child outlived its parent"
    finally:
        if pid.is_file() and psutil.pid_exists(int(pid.read_text())):
            psutil.Process(int(pid.read_text())).kill()


TEARDOWN_PROBE = """
import gc, runpy, sys
gc.disable()  # the imports' allocations would collect the cycle early: only the teardown's collection may
class Cycle:  # kept alive by a cycle: only the interpreter's teardown would finalise it
    def __del__(self):
        print("teardown ran", flush=True)
c = Cycle(); c.me = c; del c
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("module", ["pacs_megatron.reward.worker", "pacs_megatron.launch.engine_rank"])
def test_the_engine_process_and_the_reward_worker_exit_without_teardown(module):
    """Old code: ``sys.exit(main())`` / a plain return, and the interpreter's teardown finalised the cycle.
    The reward worker gets a reward and a stop message; the engine, started without its trainer's store and
    index, fails its start (exit 1) as it would when its trainer is gone."""
    import os
    import socket

    from pacs_megatron.rollout.remote.protocol import INDEX_ENV, STORE_ENV

    env = {k: v for k, v in os.environ.items() if k not in (INDEX_ENV, STORE_ENV)}
    argv, fds, parent = [sys.executable, "-c", TEARDOWN_PROBE, module], (), None
    if module.endswith("worker"):
        from multiprocessing.connection import Connection

        mine, theirs = socket.socketpair()
        parent = Connection(mine.detach())
        parent.send(("init", "arith", sys.path))
        parent.send(None)
        argv.append(str(theirs.fileno()))
        fds = (theirs.fileno(),)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, pass_fds=fds)
    finally:
        if parent is not None:
            theirs.close()
            assert parent.recv() == ("ready", None)
            parent.close()
    assert out.returncode == (0 if parent is not None else 1), out.stderr[-3000:]
    assert "teardown ran" not in out.stdout, out.stdout
