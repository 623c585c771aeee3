"""examples/configs/own_data.yaml is recipe-neutral (issue 42: training your own data with cpu_smollm2.yaml kept its
arithmetic one-shot and its 48-token limit): no worked examples, a response budget for worded problems, the math
task and reward, and nothing inherited through ``base:``. Its one-step run is in the README's own-data section."""

from __future__ import annotations

from pathlib import Path

import yaml

from pacs_megatron.config import load_config

REPO = Path(__file__).resolve().parents[2]
OWN = REPO / "examples" / "configs" / "own_data.yaml"
FIXTURE = REPO / "tests" / "fixtures" / "own_data.jsonl"


def test_own_data_inherits_no_recipe():
    raw = yaml.safe_load(OWN.read_text())
    assert "base" not in raw  # nothing from cpu_smollm2.yaml or any other recipe
    cfg = load_config(OWN, [f"data.train_files=[{FIXTURE}]"])
    assert cfg.data.shots == [] and cfg.data.task == "math" and cfg.reward.fn == "math"
    assert cfg.rollout.max_response_length >= 256  # worded problems reason for a few hundred tokens
    assert cfg.data.train_files == [str(FIXTURE)] and cfg.trainer.test_freq == 0
    smollm2 = load_config(REPO / "examples" / "configs" / "cpu_smollm2.yaml")
    assert smollm2.data.shots and smollm2.rollout.max_response_length == 48  # what own_data.yaml does not keep
