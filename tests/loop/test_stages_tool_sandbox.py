"""The loop's record of the tools' sandbox (loop/stages.py tool_sandbox, issue 57): nothing for a single-turn run;
for a tool run the level in force with its limits (final.json) and the numbers of the first metrics row."""

from __future__ import annotations

import pytest

from pacs_megatron.config.run import load_config
from pacs_megatron.envs.isolation import find_bwrap
from pacs_megatron.loop.stages import tool_sandbox

CONFIG = "examples/configs/cpu_tiny.yaml"


def test_a_single_turn_run_records_no_sandbox():
    assert tool_sandbox(load_config(CONFIG, [])) == (None, {})


@pytest.mark.subprocess  # the level's probe starts one sandbox
def test_a_tool_run_records_its_level_and_limits():
    if find_bwrap() is None:
        pytest.skip("bubblewrap is not installed: apt-get install bubblewrap")
    on = ["rollout.multi_turn.max_turns=3", "tools.memory_mb=768", "tools.max_processes=32"]
    record, first = tool_sandbox(load_config(CONFIG, on))
    assert record["level"] == "bwrap" and record["memory_mb_per_process"] <= 768
    assert first["tools/sandbox_level"] == 2.0 and first["tools/sandbox_process_memory_mb"] <= 768
    if record["memory_cap"].startswith("cgroup"):  # one cap per call, as configured
        assert first["tools/sandbox_memory_mb"] == 768 and first["tools/sandbox_max_processes"] == 32
