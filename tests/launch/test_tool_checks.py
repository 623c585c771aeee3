"""Preflight of tool-integrated rollouts (launch/tool_checks.py): a sandbox that cannot start, an unknown tool and
a chat template that cannot render a tool turn each stop the run in one line naming the field and the fix."""

from __future__ import annotations

import pytest
from _ascii import CHATML, ascii_tokenizer

from pacs_megatron.config import ConfigError
from pacs_megatron.config.run import load_config
from pacs_megatron.envs import sandbox
from pacs_megatron.launch.tool_checks import check_tools

CONFIG = "examples/configs/cpu_tiny.yaml"
ON = ["rollout.multi_turn.max_turns=3", "data.arith.style=words", "reward.fn=math_boxed", "data.chat_template=model"]


def _model(tmp_path, template=CHATML):
    ascii_tokenizer(template).save_pretrained(str(tmp_path / "m"))
    return f"model.path={tmp_path / 'm'}"


def test_single_turn_runs_check_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "check_sandbox", lambda *a, **k: pytest.fail("checked a single-turn run"))
    check_tools(load_config(CONFIG, ["tools.sandbox=bwrap", "tools.enabled=[nosuch_tool]"]))


@pytest.mark.subprocess  # the sandbox probe starts bubblewrap once
def test_a_good_setup_passes_and_each_bad_input_is_one_line(tmp_path, monkeypatch):
    check_tools(load_config(CONFIG, [*ON, _model(tmp_path)]))
    with pytest.raises(ConfigError, match="nosuch_tool") as e:
        check_tools(load_config(CONFIG, [*ON, _model(tmp_path), "tools.enabled=[python, nosuch_tool]"]))
    assert "\n" not in str(e.value)
    no_tool = CHATML.replace("{%- for m in messages -%}", "{%- for m in messages if m['role'] != 'tool' -%}")
    with pytest.raises(ConfigError, match="data.chat_template=qwen2.5") as e:
        check_tools(load_config(CONFIG, [*ON, _model(tmp_path / "x", no_tool)]))
    assert "\n" not in str(e.value) and "rollout.multi_turn.max_turns=3" in str(e.value)
    # bubblewrap that cannot start: tools.sandbox=bwrap is refused, naming the fix; auto falls back
    monkeypatch.setattr(sandbox, "_bwrap_problem", lambda *a: "bwrap: not found")
    with pytest.raises(ConfigError, match="tools.sandbox=bwrap.*apt-get install bubblewrap") as e:
        check_tools(load_config(CONFIG, [*ON, _model(tmp_path), "tools.sandbox=bwrap"]))
    assert "\n" not in str(e.value)
    check_tools(load_config(CONFIG, [*ON, _model(tmp_path), "tools.sandbox=auto"]))
