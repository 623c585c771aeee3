"""The built-in ``python`` tool: run the model's snippet in the sandbox, answer with what it printed.

What the model sees (:func:`format_output`): the snippet's stdout; on failure, then the last lines of its
stderr (the traceback's end, where the error is) and one bracketed line saying how it ended when a limit
stopped it; "[no output]" for a silent success (the model should learn to print). Everything is cut to
``tools.max_output_chars`` with a marker (the stderr tail keeps up to half of it).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping
from typing import Any

from pacs_megatron.envs.result import ToolResult, truncate
from pacs_megatron.envs.sandbox import Limits, Sandbox, SandboxResult

STDERR_LINES = 20
"""Lines of stderr shown on failure: a traceback's end holds the error."""

PYTHON_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run a Python 3 script in a fresh sandbox and return what it prints (stdout; the error's last lines "
            "if it fails). No network, no files kept between calls; the standard library (and numpy, sympy where "
            "installed) can be imported. Print the values you need."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python source to run."}},
            "required": ["code"],
        },
    },
}
"""The tool's description in the OpenAI / chat-template ``tools=[...]`` format."""


def _ending(result: SandboxResult, limits: Limits) -> str:
    """One line saying which limit stopped the call ("" for an ordinary exit or traceback)."""
    if result.kind == "timeout":
        return f"[stopped: ran past the time limit of {limits.wall_seconds:g} s]"
    if result.kind == "cpu_limit":
        return f"[stopped: used the CPU limit of {limits.cpu_seconds:g} s]"
    if result.kind == "memory_limit":
        return f"[stopped: ran out of memory (limit {limits.memory_mb} MiB)]"
    if result.kind == "output_limit":
        return f"[stopped: printed more than {limits.output_bytes} bytes]"
    if result.kind == "crash":
        name = signal.Signals(result.signal).name if result.signal in signal.valid_signals() else result.signal
        return f"[crashed: killed by signal {name}]"
    if result.kind == "sandbox_error":
        return "[error: the sandbox could not run the code]"
    if result.kind == "error" and not result.stderr.strip():
        return f"[exit status {result.exit_code}]"
    return ""


def format_output(result: SandboxResult, limits: Limits) -> str:
    """The text the model sees for ``result`` (see the module's docstring), at most about max_output_chars.

    Example:
        >>> ok = SandboxResult("ok", "56088\\n", "", 0, None, 0.1)
        >>> format_output(ok, Limits())
        '56088\\n'
    """
    if result.ok:
        return truncate(result.stdout, "", limits.max_output_chars) if result.stdout else "[no output]"
    tail = ""
    if result.kind != "sandbox_error" and result.stderr.strip():
        tail = "\n".join(result.stderr.rstrip().splitlines()[-STDERR_LINES:]) + "\n"
    ending = _ending(result, limits)
    if ending:
        tail += ending + "\n"
    head = result.stdout if not result.stdout or result.stdout.endswith("\n") else result.stdout + "\n"
    return truncate(head, tail, limits.max_output_chars)


def run_python(code: str, sandbox: Sandbox) -> ToolResult:
    """Run ``code`` in ``sandbox``; the model's text and how the call ended. Never raises for the code's sake."""
    t0 = time.monotonic()
    result = sandbox.run(code)
    return ToolResult(format_output(result, sandbox.limits), result.kind, time.monotonic() - t0, "python")


def python_tool(arguments: Mapping[str, Any], sandbox: Sandbox) -> ToolResult:
    """The ``python`` tool as the registry calls it: ``arguments`` is ``{"code": "<source>"}``."""
    code = arguments.get("code") if isinstance(arguments, Mapping) else None
    if not isinstance(code, str):
        got = sorted(arguments) if isinstance(arguments, Mapping) else type(arguments).__name__
        return ToolResult(
            f'error: the python tool takes {{"code": "<python source>"}}, got {got}', "bad_call", name="python"
        )
    return run_python(code, sandbox)
