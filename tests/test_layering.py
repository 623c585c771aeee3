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
# megatron, vllm, pacs/ pure torch, no actor <-> reference circle, the run config, the layers, the loop's layers
CONTRACTS = 7


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
    _plant(pkg / "config" / "data.py", "from pacs_megatron.launch.checks import preflight  # noqa")
    _plant(pkg / "actor" / "reference.py", "from pacs_megatron.actor.actor import MegatronActor  # noqa")
    _plant(pkg / "loop" / "stages.py", "from pacs_megatron.loop import train  # noqa")  # a stage up the loop
    _plant(pkg / "batch" / "rows.py", "from pacs_megatron.pacs import loss  # noqa")  # the ground floor looks up
    _plant(pkg / "data" / "sampler.py", "from pacs_megatron.config.run import RunConfig  # noqa")  # below the loop
    (pkg / "newfolder").mkdir()  # a folder the layers do not place
    (pkg / "newfolder" / "__init__.py").write_text("")
    code, out = _lint(tmp_path, pythonpath=tmp_path)  # the copy, not the installed package
    assert code == 1, out
    assert f"Contracts: 0 kept, {CONTRACTS} broken" in out, out  # each planted import breaks its contract
    for planted in [
        "pacs_megatron.pacs.loss -> vllm",
        "pacs_megatron.pacs.advantage -> torch.distributed",
        "pacs_megatron.rollout.types -> megatron",
        "pacs_megatron.config.data -> pacs_megatron.launch.checks.preflight",
        "pacs_megatron.actor.reference -> pacs_megatron.actor.actor",
        "pacs_megatron.loop.stages -> pacs_megatron.loop.train",
        "pacs_megatron.batch.rows -> pacs_megatron.pacs.loss",
        "pacs_megatron.data.sampler -> pacs_megatron.config.run",
        "pacs_megatron.newfolder",
    ]:
        assert planted in out, (planted, out)


def _folder_graph() -> dict[str, set[str]]:
    """The package's imports with each folder (and top-level module) as one node: what a reader navigates."""
    import grimp

    graph = grimp.build_graph("pacs_megatron", cache_dir=None)

    def node(module: str) -> str:
        return module.split(".")[1] if "." in module else "__init__"

    edges: dict[str, set[str]] = {node(m): set() for m in graph.modules}
    for m in graph.modules:
        for imported in graph.find_modules_directly_imported_by(m):
            if imported.startswith("pacs_megatron") and node(imported) != node(m):
                edges[node(m)].add(node(imported))
    return edges


def test_the_folder_graph_is_acyclic_and_at_most_eleven_levels_tall():
    """Issue 41 item 5: no folder knot (cli, launch, tools and bench once imported each other, held by two
    ignore_imports), no ignored import, and the longest chain of folders is at most 11 (it was 13; issue 60 put
    batch/ under pacs/ as the ground floor). The step's rows are batch/'s: actor/ and weight_sync/ skip data/."""
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert all(not c.get("ignore_imports") for c in contracts)
    edges = _folder_graph()
    levels: dict[str, int] = {}

    def level(n: str, path: tuple[str, ...] = ()) -> int:
        assert n not in path, f"import cycle: {' -> '.join((*path, n))}"
        if n not in levels:
            levels[n] = 1 + max((level(m, (*path, n)) for m in edges[n]), default=0)
        return levels[n]

    tallest = max(level(n) for n in edges)
    assert tallest <= 11, sorted(levels.items(), key=lambda kv: -kv[1])
    assert edges["batch"] == set(), edges["batch"]  # the ground floor imports nothing of the package
    assert "data" not in edges["actor"] | edges["weight_sync"]


RUN_CONFIG_NAMES = {"RunConfig", "load_config", "config_from_dict", "to_yaml", "run"}
"""What config/__init__ re-exports of config/run.py (and the module itself)."""
RUN_CONFIG_USERS = {"loop", "launch", "tools", "bench", "run", "config", "cli", "__main__"}
"""Where the run config may be named: pyproject.toml's "the run config stops at the loop" contract."""


def test_the_run_config_is_named_only_above_the_components():
    """Issue 60 R5: import-linter sees modules, not names, so ``from pacs_megatron.config import RunConfig`` (the
    package re-exports it) escapes its contract; this scan holds it, imports inside functions and TYPE_CHECKING too."""
    import ast

    found = []
    for path in sorted((REPO / "pacs_megatron").rglob("*.py")):
        rel = path.relative_to(REPO / "pacs_megatron")
        if (rel.parts[0] if len(rel.parts) > 1 else rel.stem) in RUN_CONFIG_USERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module, names = node.module or "", {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                module, names = "", {a.name for a in node.names}
            else:
                continue
            run_module = module.startswith("pacs_megatron.config.run") or any(
                n.startswith("pacs_megatron.config.run") for n in names
            )
            if run_module or (module == "pacs_megatron.config" and RUN_CONFIG_NAMES & names):
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"the run config below the loop (take the sections instead, loop/build.py): {found}"
