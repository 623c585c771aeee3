"""run/layout.py: every entry of a run directory and of a checkpoint is named there and nowhere else."""

from __future__ import annotations

import ast
from pathlib import Path

from pacs_megatron.run.layout import DistLayout, RunLayout, StepLayout

PACKAGE = Path(__file__).resolve().parents[2] / "pacs_megatron"


def _owned_names() -> set[str]:
    """The last component of every path the three layouts give (their properties and methods)."""
    run = RunLayout(Path("R"))
    step = run.step_dir(7)
    paths = [getattr(run, n) for n in ("lock", "metrics", "rollouts", "final", "configs", "launch", "tensorboard")]
    paths += [run.plots, run.checkpoints, run.config, run.export, run.eval_set("x").parent, step.marker]
    paths += [step.megatron.path, step.extra_state, step.hf, step.critic, step.reference.path]
    paths += [step.megatron.metadata_json, step.megatron.common, step.megatron.index]
    return {p.name for p in paths}


NOT_RUN_PATHS = {
    "tools/selftest_checks.py": {"configs"},  # the repository's examples/configs
    "launch/ray_rank.py": {"config.yaml"},  # a rank's own temporary copy of the config, not the run's
    "bench/async_rollout.py": {"configs"},  # the repository's examples/configs
    "bench/dtype_pilot.py": {"configs"},  # the repository's examples/configs
    "bench/rl_step.py": {"config.yaml", "step_s", "step_cpu_s", "step_rss_gb"},  # its input config; record keys
}
"""Same names, other directories."""

STEP_PATTERNS = ("step_", ".tmp_step_", "corrupt_step_", "superseded_step_", "launch_")
"""Prefixes of the numbered entries (``step_{n:08d}``, ``launch_{n:03d}.yaml``) and of their globs."""


def _spellings(tree: ast.AST, owned: set[str]) -> list[tuple[int, str]]:
    """(line, text) of each owned name used as a path part: the right side of ``/``, an argument of a call
    (``Path(...)``, ``.glob(...)``, ``open(...)``), a numbered entry's prefix in an f-string, or an owned
    file name (one with a dot) as a whole string anywhere."""
    found = []
    for node in ast.walk(tree):
        parts: list[ast.AST] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts.append(node.right)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") not in ("getattr", "hasattr", "setattr"):
            parts += node.args  # (an attribute's name is not a path)
        for part in parts:
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                text = part.value
                if text in owned or text.startswith(STEP_PATTERNS):
                    found.append((part.lineno, text))
            elif isinstance(part, ast.JoinedStr):
                head = part.values[0] if part.values else None
                if isinstance(head, ast.Constant) and str(head.value).startswith(STEP_PATTERNS):
                    found.append((part.lineno, f"f-string {head.value!r}..."))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            if node.value in owned:
                found.append((node.lineno, node.value))
    return sorted(set(found))


def test_no_run_directory_name_is_spelled_outside_run():
    owned = _owned_names()
    assert {"metrics.jsonl", "rollouts.jsonl", "COMPLETE", "extra_state.json", "hf", "critic"} <= owned
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "run":
            continue
        for line, text in _spellings(ast.parse(path.read_text()), owned):
            if text in NOT_RUN_PATHS.get(str(rel), ()):
                continue
            offenders.append(f"pacs_megatron/{rel}:{line}: {text}")
    assert not offenders, "ask run/layout.py for these paths:\n" + "\n".join(offenders)


def test_the_scan_sees_a_spelled_name():
    """The check above can fail: each shape it looks for is found in a snippet."""
    owned = _owned_names()
    code = (
        "p = root / 'metrics.jsonl'\n"
        "q = Path(root, 'checkpoints')\n"
        "r = root / f'step_{step:08d}'\n"
        "s = sorted(d.glob('step_*'))\n"
        "NAME = 'extra_state.json'\n"
        "engine = 'hf'  # a choice, not a path: not flagged\n"
    )
    assert [line for line, _ in _spellings(ast.parse(code), owned)] == [1, 2, 3, 4, 5]


def test_a_step_layout_knows_its_step_and_completeness(tmp_path):
    run = RunLayout(tmp_path)
    assert run.checkpoint_steps() == [] and not run.has_run()
    for step in (3, 12):
        run.step_dir(step).path.mkdir(parents=True)
    run.step_dir(12).marker.write_text("{}")
    run.staging_dir(14).mkdir()
    assert [s for s, _ in run.checkpoint_steps()] == [12] and run.has_run()
    assert run.step_dir(12).step == 12 and StepLayout(tmp_path).step is None
    assert run.staging_dirs() == [run.staging_dir(14)]
    assert run.corrupt_dir("step_00000003", 2).name == "corrupt_step_00000003.2"
    assert isinstance(run.step_dir(1).reference, DistLayout) and RunLayout(str(tmp_path)).root == tmp_path
