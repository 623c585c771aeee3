"""A setting whose package is not installed is one line and exit 2 at launch, naming the pip command (issue 42,
FAIL 1: ``logging.wandb_project`` without wandb ran 104 s into the ranks and died with two tracebacks)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from pacs_megatron.config import ConfigError, load_config
from pacs_megatron.launch.checks.preflight import preflight
from pacs_megatron.launch.optional_deps import NEEDS, check_optional_deps

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "cpu_tiny.yaml"

CASES = {
    "wandb": (["logging.wandb_project=my-runs"], "logging.wandb_project='my-runs' needs wandb", "pip install wandb"),
    "ray reward": (["reward.backend=ray", "reward.num_workers=1"], "reward.backend=ray needs ray", "pip install"),
    "ray launcher": (["launcher.kind=ray"], "launcher.kind=ray / reward.backend=ray needs ray", "ray>=2.40"),
    "tensorboard": ([], "logging.tensorboard needs tensorboard", "logging.tensorboard=false"),
    "rich": (["logging.tensorboard=false"], "logging.progress_bar needs rich", "logging.progress_bar=false"),
    "math_verify": (["data.task=math", "reward.fn=math"], "reward.fn needs math_verify", "math-verify"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_setting_names_its_package_and_pip_command(name):
    overrides, what, fix = CASES[name]
    cfg = load_config(CONFIG, overrides)
    module = {"ray reward": "ray", "ray launcher": "ray"}.get(name, name)
    with pytest.raises(ConfigError) as e:
        check_optional_deps(cfg, have=lambda m: m != module)
    line = str(e.value)
    assert what in line and fix in line and "\n" not in line
    check_optional_deps(cfg, have=lambda m: True)  # installed: nothing to say


def test_a_setting_left_off_needs_nothing():
    cfg = load_config(CONFIG, ["logging.tensorboard=false", "logging.progress_bar=false"])
    check_optional_deps(cfg, have=lambda m: m not in {n.module for n in NEEDS})  # only what tiny needs: none


def test_preflight_runs_the_check(monkeypatch):
    """Fails on the old code: preflight() looked at vllm and modelopt only."""
    import pacs_megatron.launch.optional_deps as deps

    monkeypatch.setattr(deps, "installed", lambda m: m != "wandb")
    cfg = load_config(CONFIG, ["logging.wandb_project=x"])
    with pytest.raises(ConfigError, match="pip install wandb"):
        preflight(cfg)


@pytest.mark.subprocess
@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_project_without_wandb_is_one_line_before_any_rank(tmp_path):
    """The user's command as filed (FAIL 1), as a dry run: exit 2 and one error line, where the old code
    printed the config and exited 0 (and the real run failed inside the ranks)."""
    cmd = [sys.executable, "-m", "pacs_megatron", "train", "--config", str(CONFIG), "--dry-run"]
    cmd += ["logging.wandb_project=X", f"trainer.output_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if " E " in ln]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and "pip install wandb" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
