"""The metrics table names every key the code logs (issue 29: 33 of 47 were named; it moved with "What a run
writes" from the README to docs/guide.md, issue 42), and the README's folder table every folder and top-level
module of the package (issue 30: 7 of them were missing); the README stays a front page whose commands match
CI's and whose links resolve."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMESPACES = "actor|async|critic|data|moe|overlong|pacs|perf|policy|response|reward|rollout|sampling|sft|sync|timing"
KEY = re.compile(rf"[\"']((?:{NAMESPACES})/[a-z0-9_@]+)[\"']")


def logged_keys() -> set[str]:
    """Metric keys spelled out in the package (string literals ``"ns/name"``), expanded where the code
    builds them: the post-update copies of the PACS metrics and the phase timers."""
    keys = set()
    for path in (REPO / "pacs_megatron").rglob("*.py"):
        keys |= set(KEY.findall(path.read_text()))
    keys = {k for k in keys if not k.endswith("_")}  # prefixes ("pacs/post_") are expanded below
    keys -= {"critic/megatron"}  # a checkpoint folder (run/checkpoint_check.py), not a metric
    from pacs_megatron.pacs.registry import POST_PREFIX, POST_SKIP

    keys |= {POST_PREFIX + k.split("/", 1)[1] for k in keys if k.startswith("pacs/") and "post" not in k}
    not_recomputed = {*POST_SKIP, "pacs/first_minibatch_max_logratio"}
    keys -= {POST_PREFIX + k.split("/", 1)[1] for k in not_recomputed}
    phases = re.findall(r'timer\("(\w+)"\)', (REPO / "pacs_megatron" / "loop" / "train.py").read_text())
    return keys | {f"timing/{p}_s" for p in phases} | {f"timing/{p}_cpu_s" for p in phases}


def test_every_logged_metric_is_in_the_metrics_table():
    guide = (REPO / "docs" / "guide.md").read_text()
    keys = logged_keys()
    assert {"reward/mean", "pacs/post_loss", "timing/rollout_s", "critic/value_loss"} <= keys  # the scan works
    missing = sorted(k for k in keys if f"`{k}`" not in guide)
    assert not missing, f"docs/guide.md's metrics table lacks {missing}"


def test_the_folder_table_names_every_folder_and_module():
    readme = (REPO / "README.md").read_text()
    table = readme.split("| folder | what |", 1)[1].split("\n\n", 1)[0]
    named = {cell for row in table.splitlines()[2:] for cell in re.findall(r"`([^`]+)`", row.split("|")[1])}
    package = REPO / "pacs_megatron"
    parts = [p for p in package.iterdir() if (p / "__init__.py").is_file() or p.suffix == ".py"]
    assert len(parts) > 15  # the scan works (the loop sits in one folder, loop/)
    wanted = {f"pacs_megatron/{p.name}/" if p.is_dir() else p.name for p in parts if p.name != "__init__.py"}
    missing = sorted(w for w in wanted if w not in named and f"pacs_megatron/{w}" not in named)
    assert not missing, f"README.md's folder table (## One step, one folder) lacks {missing}"


def test_the_readme_is_a_front_page_with_ci_s_test_command_and_live_links():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 220, "README.md is a front page: move details to docs/guide.md"
    ci = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.startswith("python3 -m venv")]
    assert len(ci) == 1 and ci[0] in readme.splitlines()  # byte-identical, as .ci/run says
    hidden = [
        ln[ln.index("PACS_HIDE_EXTRAS=") :]
        for ln in (REPO / ".ci" / "run").read_text().splitlines()
        if " pytest" in ln and "PACS_HIDE_EXTRAS=" in ln
    ]
    assert len(hidden) == 1 and f"`{hidden[0]}`" in readme  # the fast tier without the extras, as CI runs it
    assert "## Results" in readme  # the lead's PACS v1/v2 paragraph goes there
    for target in re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", readme):
        assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"
    for config in re.findall(r"examples/configs/[\w.]+\.yaml", readme):
        assert (REPO / config).is_file(), f"README.md names {config}, which does not exist"
