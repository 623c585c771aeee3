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
