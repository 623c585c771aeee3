"""The house's import rules hold (pyproject.toml's ``[tool.importlinter]`` contracts, issue 30), and the lint
fails on planted violations, imports inside functions among them (130 of the package's imports are there)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONTRACTS = 5  # megatron, vllm, pacs/ pure torch, no actor <-> reference circle, the layers


def _lint(cwd: Path, pythonpath: Path | None = None) -> tuple[int, str]:
    """import-linter in a fresh process: its CLI calls ``logging.config.dictConfig``, which disables every
    logger that exists (the package's included), so in-process it broke the log checks of later tests."""
    lint = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    env = {**os.environ, **({"PYTHONPATH": str(pythonpath)} if pythonpath else {})}
    run = subprocess.run([sys.executable, "-c", lint], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return run.returncode, " ".join(run.stdout.split())  # rich wraps long lines


@pytest.mark.subprocess
def test_the_import_contracts_hold():
    code, out = _lint(REPO)
    assert code == 0, out
    assert f"Contracts: {CONTRACTS} kept, 0 broken" in out, out  # every contract ran


def _plant(path: Path, body: str) -> None:
    """Append a function whose body holds the import: a module-level scan would not see it."""
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {body}\n")


@pytest.mark.subprocess
def test_planted_violations_inside_functions_fail_the_lint(tmp_path):
    skip = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(REPO / "pacs_megatron", tmp_path / "pacs_megatron", ignore=skip)
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    pkg = tmp_path / "pacs_megatron"
    _plant(pkg / "pacs" / "loss.py", "import vllm  # noqa")
    _plant(pkg / "pacs" / "advantage.py", "import torch.distributed  # noqa")
    _plant(pkg / "rollout" / "types.py", "from megatron.core import parallel_state  # noqa")
    _plant(pkg / "config" / "data.py", "from pacs_megatron.launch import preflight  # noqa")
    _plant(pkg / "actor" / "reference.py", "from pacs_megatron.actor.actor import MegatronActor  # noqa")
    (pkg / "newfolder").mkdir()  # a folder the layers do not place
    (pkg / "newfolder" / "__init__.py").write_text("")
    code, out = _lint(tmp_path, pythonpath=tmp_path)  # the copy, not the installed package
    assert code == 1, out
    assert f"Contracts: 0 kept, {CONTRACTS} broken" in out, out  # each planted import breaks its contract
    for planted in [
        "pacs_megatron.pacs.loss -> vllm",
        "pacs_megatron.pacs.advantage -> torch.distributed",
        "pacs_megatron.rollout.types -> megatron",
        "pacs_megatron.config.data -> pacs_megatron.launch.preflight",
        "pacs_megatron.actor.reference -> pacs_megatron.actor.actor",
        "pacs_megatron.newfolder",
    ]:
        assert planted in out, (planted, out)
