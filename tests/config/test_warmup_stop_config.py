"""``trainer.sft_warmup_stop`` (issue 58, item 2): a fixed count by default, the measured criterion in the tool
recipe, set from YAML or ``a.b=c``; bad values refused in one line naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from pacs_megatron.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
TOOLS = ["rollout.multi_turn.max_turns=3", "tools.enabled=[python]", "trainer.sft_warmup_steps=10"]


def test_fixed_count_by_default_and_the_tool_recipe_measures():
    assert load_config().trainer.sft_warmup_stop.until == "steps"
    for path in CONFIGS.glob("*.yaml"):
        cfg = load_config(path)
        stop = cfg.trainer.sft_warmup_stop
        assert stop.until == ("valid_calls" if cfg.rollout.multi_turn.enabled else "steps"), path.name
    tools = load_config(CONFIGS / "cpu_smollm2_tools.yaml").trainer
    # the maximum leaves room past the 14 steps the fp32 sweep needed for 0.556 held-out
    # (docs/results/smollm2_tools_cpu)
    assert tools.sft_warmup_stop.threshold == 0.8 and tools.sft_warmup_steps >= 20


def test_overrides_set_every_field():
    keys = ["until=valid_calls", "threshold=0.9", "check_every=3", "held_out=16", "samples=2"]
    cfg = load_config(None, [*TOOLS, *(f"trainer.sft_warmup_stop.{k}" for k in keys)])
    stop = cfg.trainer.sft_warmup_stop
    assert (stop.until, stop.threshold, stop.check_every, stop.held_out, stop.samples) == ("valid_calls", 0.9, 3, 16, 2)
    recipe = load_config(CONFIGS / "cpu_smollm2_tools.yaml", ["trainer.sft_warmup_stop.until=steps"])
    assert recipe.trainer.sft_warmup_stop.until == "steps"  # the fixed warm-up, for an exact reproduction


@pytest.mark.parametrize(
    "override, words",
    [
        ("until=loss", "trainer.sft_warmup_stop.until='loss' is not valid: choose one of"),
        ("threshold=0", r"threshold=0.0 must be in \(0, 1\]"),
        ("threshold=1.5", r"threshold=1.5 must be in \(0, 1\]"),
        ("check_every=0", "trainer.sft_warmup_stop.check_every=0 must be > 0"),
        ("held_out=0", "trainer.sft_warmup_stop.held_out=0 must be > 0"),
        ("samples=-1", "trainer.sft_warmup_stop.samples=-1 must be > 0"),
    ],
)
def test_errors_name_the_field(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, [*TOOLS, f"trainer.sft_warmup_stop.{override}"])


def test_valid_calls_needs_tools_and_a_maximum():
    with pytest.raises(ConfigError, match="needs rollout.multi_turn.max_turns >= 2.*until=steps"):
        load_config(CONFIGS / "cpu_tiny.yaml", ["trainer.sft_warmup_stop.until=valid_calls"])
    with pytest.raises(ConfigError, match="set trainer.sft_warmup_steps > 0"):
        load_config(None, [*TOOLS, "trainer.sft_warmup_stop.until=valid_calls", "trainer.sft_warmup_steps=0"])
