"""Can this process write where a command will write? Asked before any heavy work, in every command.

``train`` (``trainer.output_dir``, launch/checks/preflight.py), ``eval --out``, ``export OUT``, ``parity --out``,
``selftest --out``, ``compare --out`` and ``plot --out`` call these first, so a read-only disk, a path that
is a file, or a folder under a file is one line naming the key and the fix, not a traceback after the
sampling or training that the write was meant to keep.

The test is a real write: a temporary file is created and removed in the directory (or in its
nearest existing ancestor, when the directory is still to be made). Permission bits are not enough:
root passes every ``os.access`` check, also on a read-only mount. Nothing else is created.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from pacs_megatron.config.base import ConfigError


def named(key: str, value: str | Path) -> str:
    """How a message names a setting: ``model.path='/x'`` for a config key, ``--out /x`` for a flag or an
    argument (``OUT_DIR /x``)."""
    if "." in key and not key.startswith("-") and " " not in key:
        return f"{key}={str(value)!r}"
    return f"{key} {value}"


def os_error_text(e: OSError) -> str:
    """``"EROFS (Read-only file system)"``: the errno's name and its text."""
    name = errno.errorcode.get(e.errno or 0, str(e.errno))
    return f"{name} ({e.strerror or os.strerror(e.errno or 0)})"


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe(key: str, path: Path, directory: Path) -> None:
    try:
        fd, name = tempfile.mkstemp(prefix=".pacs-write-test-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise ConfigError(
            f"{named(key, path)}: cannot write in {directory}: {os_error_text(e)}; choose a writable place"
        ) from None


def check_writable_dir(key: str, path: str | Path) -> None:
    """``path`` is, or can be made as, a directory this process can write into (ConfigError naming ``key``)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{named(key, path)} is a file, not a directory: choose a directory (or remove the file)")
    base = p if p.is_dir() else _nearest_existing(p)
    if not base.is_dir():
        raise ConfigError(f"{named(key, path)}: {base} is a file, so no directory can be made under it")
    _probe(key, p, base)


def check_writable_file(key: str, path: str | Path) -> None:
    """``path`` can be written as a file: not a directory, and its folder is (or can be made) writable."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{named(key, path)} is a directory: give a file name")
    base = _nearest_existing(p.parent)
    if not base.is_dir():
        raise ConfigError(f"{named(key, path)}: {base} is a file, so no folder can be made under it")
    _probe(key, p, base)


def check_readable_file(key: str, path: str | Path) -> None:
    """``path`` is an existing, readable file (ConfigError naming ``key``)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{named(key, path)}: no such file")
    if p.is_dir():
        raise ConfigError(f"{named(key, path)} is a directory: give a file")
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as e:
        raise ConfigError(f"{named(key, path)}: cannot read it: {os_error_text(e)}") from None
