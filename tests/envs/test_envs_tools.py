"""The python tool's text, the tool registry, ToolsConfig's checks and the local pool (issue 45)."""

from __future__ import annotations

import re

import pytest
from _sandbox_helpers import startable_level

from pacs_megatron.config import ConfigError
from pacs_megatron.config.tools import ToolsConfig
from pacs_megatron.envs.pool import LocalToolPool, make_pool
from pacs_megatron.envs.python_tool import PYTHON_SCHEMA, format_output, python_tool
from pacs_megatron.envs.registry import Toolbox, ToolError, load_tool, tool_name
from pacs_megatron.envs.result import ToolResult, tool_metrics, truncate
from pacs_megatron.envs.sandbox import Limits, SandboxResult


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("sandbox", "docker", "tools.sandbox='docker' is not valid"),
        ("sandbox", "rlimits", "tools.sandbox=rlimits is renamed tools.sandbox=rlimits-trusted"),
        ("backend", "slurm", "tools.backend='slurm' is not valid"),
        ("cpu_seconds", 0, "tools.cpu_seconds=0 must be > 0"),
        ("wall_seconds", -1, "tools.wall_seconds=-1 must be > 0"),
        ("memory_mb", 16, "tools.memory_mb=16 is too small"),
        ("max_output_chars", 0, "tools.max_output_chars=0"),
        ("max_processes", 2, "tools.max_processes=2"),
        ("workers", 0, "tools.workers=0"),
        ("enabled", ("python", "my tool"), "tools.enabled has 'my tool'"),
        ("enabled", ("python", "python"), "names a tool twice"),
        ("packages", ("numpy", "a.b"), "tools.packages has 'a.b'"),
    ],
)
def test_tools_config_names_the_field(field, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        ToolsConfig(**{field: value})
    assert "\n" not in str(e.value)


def test_tools_config_defaults_and_lists():
    cfg = ToolsConfig(enabled=["python", "pkg.mod:fn"], packages=["numpy"])  # as YAML hands them
    assert cfg.enabled == ("python", "pkg.mod:fn") and cfg.packages == ("numpy",)
    assert ToolsConfig().sandbox == "auto" and ToolsConfig().output_bytes == 16384


def _result(kind, stdout="", stderr="", exit_code=None, sig=None):
    return SandboxResult(kind, stdout, stderr, exit_code, sig, 0.1)


def test_what_the_model_sees():
    limits = Limits(wall_seconds=20, cpu_seconds=10, memory_mb=512, max_output_chars=200)
    assert format_output(_result("ok", "56088\n", "", 0), limits) == "56088\n"
    assert format_output(_result("ok", "", "a warning", 0), limits) == "[no output]"
    traceback = "Traceback (most recent call last):\n" + "".join(f"  line {i}\n" for i in range(40)) + "ValueError: x"
    text = format_output(_result("error", "partial", traceback, 1), limits)
    assert text.startswith("partial\n") and text.endswith("ValueError: x\n") and "line 0\n" not in text
    assert format_output(_result("timeout", "", "", None, 9), limits) == "[stopped: ran past the time limit of 20 s]\n"
    assert "CPU limit of 10 s" in format_output(_result("cpu_limit", sig=24), limits)
    assert "out of memory (limit 512 MiB)" in format_output(_result("memory_limit", "", "MemoryError", 1), limits)
    assert "SIGSEGV" in format_output(_result("crash", sig=11), limits)
    assert format_output(_result("error", "", "", 3), limits) == "[exit status 3]\n"
    # the cap: output cut from its end, the error's tail kept, markers where text went
    long = format_output(_result("output_limit", "y" * 5000, "", None, 9), limits)
    assert long.startswith("y" * 100) and "characters cut" in long and long.endswith("bytes]\n")
    assert len(long) < 200 + 80
    assert truncate("abc", "de", 10) == "abcde"


def test_the_python_tool_refuses_bad_arguments_without_running():
    for bad in ({}, {"code": 3}, {"source": "print(1)"}):
        result = python_tool(bad, sandbox=None)
        assert result.kind == "bad_call" and '{"code": "<python source>"}' in result.text
    assert PYTHON_SCHEMA["function"]["parameters"]["required"] == ["code"]


def test_the_registry_loads_builtins_and_user_tools():
    assert tool_name("envs_user_tools:echo") == "echo" and load_tool("python") is python_tool
    assert load_tool("envs_user_tools:echo")({"text": "hi"}, None) == "hi"
    for spec, message in [
        ("pyhton", "neither a built-in (['python'])"),
        ("envs_user_tools:missing", "has no attribute 'missing'"),
        ("envs_user_tools:NOT_CALLABLE", "not a function"),
        ("envs_user_tools:one_arg", "cannot take (arguments, sandbox)"),
        ("no_such_module_xyz:fn", "module 'no_such_module_xyz' not found"),
    ]:
        with pytest.raises(ToolError) as e:
            load_tool(spec)
        assert message in str(e.value) and f"tools.enabled has {spec!r}" in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


def test_toolbox_calls_never_raise():
    cfg = ToolsConfig(enabled=("python", "envs_user_tools:echo", "envs_user_tools:boom", "envs_user_tools:not_text"))
    box = Toolbox(cfg, sandbox=object())  # no sandboxed call here: a stand-in
    assert box.names == ["python", "echo", "boom", "not_text"]
    assert [s["function"]["name"] for s in box.schemas()] == box.names
    assert box.call("echo", '{"text": "hi"}').text == "hi"
    assert box.call("echo", {"text": "x" * 10000}).text.endswith("characters cut ...]\n")
    unknown = box.call("search", {})
    assert unknown.kind == "bad_call" and "['python', 'echo', 'boom', 'not_text']" in unknown.text
    assert box.call("echo", "{not json").kind == "bad_call"
    assert box.call("echo", "[1, 2]").kind == "bad_call"
    assert box.call("boom", {}).kind == "tool_error" and "RuntimeError: tool bug" in box.call("boom", {}).text
    assert box.call("not_text", {}).kind == "tool_error"
    with pytest.raises(ToolError, match="two tools called 'echo'"):
        Toolbox(ToolsConfig(enabled=("envs_user_tools:echo", "other_mod:echo")), sandbox=object())


def test_metrics():
    results = [ToolResult("1", "ok", 0.5), ToolResult("", "timeout", 2.0), ToolResult("e", "error", 0.25)]
    assert tool_metrics(results) == {
        "tools/calls": 3.0,
        "tools/errors": 2.0,
        "tools/timeouts": 1.0,
        "tools/seconds": 2.75,
        "tools/seconds_max": 2.0,
    }


@pytest.mark.subprocess
def test_the_local_pool_runs_calls_at_once_in_input_order():
    cfg = ToolsConfig(workers=3, wall_seconds=60, cpu_seconds=5, memory_mb=512, sandbox=startable_level())
    calls = [
        ("python", {"code": "import time; time.sleep(1); print('slow')"}),
        ("python", '{"code": "print(2 ** 10)"}'),
        ("python", {"code": "1/0"}),
        ("nope", {}),
        ("python", {"code": "print('last')"}),
    ]
    with make_pool(cfg) as pool:
        assert isinstance(pool, LocalToolPool)
        results = pool.run(calls)
    assert [r.text for r in results[:2]] == ["slow\n", "1024\n"]
    assert results[2].kind == "error" and results[2].text.endswith("ZeroDivisionError: division by zero\n")
    assert results[3].kind == "bad_call" and results[4].text == "last\n"
    metrics = tool_metrics(results)
    assert metrics["tools/calls"] == 5 and metrics["tools/errors"] == 2 and metrics["tools/seconds_max"] >= 1


@pytest.mark.parametrize("module", ["result", "registry", "python_tool"])
def test_doctests(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"pacs_megatron.envs.{module}"))
    assert result.attempted > 0 and result.failed == 0
