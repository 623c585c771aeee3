"""Tools by name: the built-in ``python`` next to user tools loaded by dotted path.

Every tool has one signature, ``fn(arguments, sandbox) -> str | ToolResult``: ``arguments`` is the call's
argument dict as the model wrote it (``{"code": ...}`` for python), ``sandbox`` the run's
:class:`~pacs_megatron.envs.sandbox.Sandbox` (run untrusted work through ``sandbox.run``: the tool function
itself runs in the trainer's process). ``tools.enabled`` names them:

- ``"python"``: run a Python snippet in the sandbox (:mod:`.python_tool`);
- ``"package.module:function"``: any importable function with that signature; the model calls it by the
  function's name (``my_pkg.tools:search`` is the tool ``search``). A ``schema`` attribute on the function
  (an OpenAI-style tool description) is what :meth:`Toolbox.schemas` hands the chat template.

Loading checks everything that can be checked before the first call (module, attribute, callable, arity) and
raises :class:`ToolError` naming the spec and the fix. :meth:`Toolbox.call` never raises: an unknown tool, bad
arguments or a tool that raises become an error text for the model and a counted error kind.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pacs_megatron.config.tools import tool_name
from pacs_megatron.envs.python_tool import PYTHON_SCHEMA, python_tool
from pacs_megatron.envs.result import ToolResult, truncate
from pacs_megatron.envs.sandbox import Sandbox
from pacs_megatron.utils.logging import get_logger
from pacs_megatron.utils.specs import load_callable

if TYPE_CHECKING:
    from pacs_megatron.config.tools import ToolsConfig

logger = get_logger(__name__)

ToolFn = Callable[[Mapping[str, Any], Sandbox], Any]
"""``fn(arguments, sandbox) -> str | ToolResult``."""

TOOLS: dict[str, ToolFn] = {"python": python_tool}
"""Built-in tools by name."""
SCHEMAS: dict[str, dict[str, Any]] = {"python": PYTHON_SCHEMA}
"""The built-ins' descriptions for the chat template."""
_LOGGED_ERRORS = 5
"""Tool exceptions logged with their traceback per Toolbox (the rest are only counted)."""


class ToolError(ValueError):
    """A tool cannot be loaded: the message names the spec and the fix."""


def load_tool(spec: str) -> ToolFn:
    """The function ``spec`` names: a key of :data:`TOOLS` or ``"package.module:function"``.

    Example:
        >>> load_tool("python") is python_tool
        True
        >>> load_tool("pacs_megatron.envs.python_tool:python_tool") is python_tool
        True
    """
    where = f"tools.enabled has {spec!r}"
    return load_callable(spec, TOOLS, where, ToolError, [{}, None], "(arguments, sandbox)")


class Toolbox:
    """The run's tools by name, and one sandbox they share; :meth:`call` is safe from many threads at once.

    Example:
        >>> from pacs_megatron.config.tools import ToolsConfig
        >>> box = Toolbox(ToolsConfig(wall_seconds=30))  # doctest: +SKIP
        >>> box.call("python", {"code": "print(123 * 456)"}).text  # doctest: +SKIP
        '56088\\n'
    """

    def __init__(self, cfg: ToolsConfig, sandbox: Sandbox | None = None) -> None:
        self.cfg = cfg
        self.tools: dict[str, ToolFn] = {}
        for spec in cfg.enabled:
            name = tool_name(spec)
            if name in self.tools:
                raise ToolError(f"tools.enabled={list(cfg.enabled)} has two tools called {name!r}: rename one")
            self.tools[name] = load_tool(spec)
        self.sandbox = sandbox if sandbox is not None else Sandbox.from_config(cfg)
        self._errors_logged = 0

    @property
    def names(self) -> list[str]:
        """The tool names the model may call."""
        return list(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' descriptions for the chat template (a user tool without a ``schema`` attribute gets a
        bare one: its name, its docstring, free-form arguments)."""
        out = []
        for name, fn in self.tools.items():
            schema = SCHEMAS.get(name) if fn is TOOLS.get(name) else getattr(fn, "schema", None)
            if schema is None:
                doc = (inspect.getdoc(fn) or name).splitlines()[0]
                schema = {
                    "type": "function",
                    "function": {"name": name, "description": doc, "parameters": {"type": "object", "properties": {}}},
                }
            out.append(schema)
        return out

    def call(self, name: str, arguments: Mapping[str, Any] | str | None = None) -> ToolResult:
        """Call tool ``name`` with ``arguments`` (a dict, or its JSON text as the model wrote it); never raises."""
        t0 = time.monotonic()
        fn = self.tools.get(name)
        if fn is None:
            return ToolResult(f"error: unknown tool {name!r}; the tools are {self.names}", "bad_call", 0.0, name)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return ToolResult(f"error: the arguments of {name} are not valid JSON ({e})", "bad_call", 0.0, name)
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            return ToolResult(
                f"error: the arguments of {name} must be a JSON object, got {type(arguments).__name__}",
                "bad_call",
                0.0,
                name,
            )
        try:
            out = fn(arguments, self.sandbox)
        except Exception as e:  # noqa: BLE001 - a tool's bug is the call's error, not the run's end
            if self._errors_logged < _LOGGED_ERRORS:
                self._errors_logged += 1
                logger.warning("tool %r raised on %.200r", name, arguments, exc_info=True)
            return ToolResult(
                f"error: tool {name} failed: {type(e).__name__}: {e}"[: self.cfg.max_output_chars],
                "tool_error",
                time.monotonic() - t0,
                name,
            )
        seconds = time.monotonic() - t0
        if isinstance(out, ToolResult):
            out.name = out.name or name
            out.seconds = out.seconds or seconds
            return out
        if isinstance(out, str):
            return ToolResult(truncate(out, "", self.cfg.max_output_chars), "ok", seconds, name)
        return ToolResult(f"error: tool {name} returned a {type(out).__name__}, not text", "tool_error", seconds, name)
