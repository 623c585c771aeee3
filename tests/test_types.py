"""mypy passes over the package with pyproject.toml's [tool.mypy] (issue 30 item 7): lenient everywhere, strict
(every def typed) on pacs/, config/ and cli.py, minus a baseline list of modules whose errors are not yet fixed."""

from __future__ import annotations

from pathlib import Path

from mypy import api

REPO = Path(__file__).resolve().parents[1]


def _mypy(*extra: str) -> tuple[str, int]:
    # the cache makes the second run incremental: only the shadowed module and its importers are checked again
    args = ["--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(REPO / ".mypy_cache"), *extra]
    out, err, status = api.run([*args, str(REPO / "pacs_megatron")])
    return out + err, status


def test_mypy_passes_and_is_strict_on_pacs(tmp_path):
    out, status = _mypy()
    assert status == 0 and "Success: no issues found" in out, out
    # an untyped def in pacs/ (strict) fails; mypy reads the shadow copy in place of the real file
    loss = REPO / "pacs_megatron" / "pacs" / "loss.py"
    shadow = tmp_path / "loss.py"
    shadow.write_text(loss.read_text() + "\n\ndef _untyped(x):\n    return x\n")
    out, status = _mypy("--shadow-file", str(loss), str(shadow))
    assert status == 1 and "loss.py:" in out and "Function is missing a type annotation" in out, out
