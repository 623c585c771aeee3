"""User tools for tests/envs: loaded by 'envs_user_tools:NAME' specs (this folder is on sys.path under pytest)."""

from __future__ import annotations


def echo(arguments, sandbox):
    """Echo the text argument back (a tool that needs no sandbox)."""
    return str(arguments.get("text", ""))


echo.schema = {"type": "function", "function": {"name": "echo", "description": "Echo text.", "parameters": {}}}


def boom(arguments, sandbox):
    """A tool with a bug."""
    raise RuntimeError("tool bug")


def not_text(arguments, sandbox):
    return 42


def one_arg(arguments):
    return ""


NOT_CALLABLE = 3
