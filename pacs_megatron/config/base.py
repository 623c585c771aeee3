"""The config error type and the two validators every area uses."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the fix."""


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid: choose one of {list(choices)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")
