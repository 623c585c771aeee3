"""Plug-ins named by a config string: a built-in's name or ``"package.module:function"`` (``reward.fn``,
``tools.enabled``), loaded and checked to take the caller's arguments before any heavy work."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def load_callable(
    spec: str,
    builtins: Mapping[str, Callable[..., Any]],
    where: str,
    error: type[Exception],
    sample_args: Sequence[Any],
    arg_names: str,
) -> Callable[..., Any]:
    """The function ``spec`` names, or ``error`` in one line starting with ``where`` (the key and value).

    ``sample_args`` are bound to its signature (nothing is called), so a function that cannot take the
    caller's ``arg_names`` positionally is refused at start-up rather than at its first call.

    Example:
        >>> load_callable("len", {"len": len}, "x", ValueError, [[]], "(obj)") is len
        True
        >>> load_callable("os.path:join", {}, "x", ValueError, ["a"], "(a)").__name__
        'join'
    """
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        raise error(f"{where}: neither a built-in ({sorted(builtins)}) nor 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise error(f"{where}: write it as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise error(f"{where}: module {module_name!r} not found ({e}); is it on PYTHONPATH?") from None
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise error(f"{where}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise error(f"{where}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(*sample_args)
    except TypeError:
        raise error(f"{where}: signature {inspect.signature(fn)} cannot take {arg_names} positionally") from None
    except ValueError:  # a C builtin without a signature: trust it
        pass
    return fn
