"""Every extra the package's dependencies ask for exists, spelled as the installed distribution spells it
(issue 58, item 7): math-verify 0.9 provides ``antlr4-13-2``, and ``math-verify[antlr4_13_2]`` made pip (23.2,
which compares extras literally, before PEP 685's normalisation) warn at every install."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _requirements() -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = list(project["dependencies"])
    for group in project.get("optional-dependencies", {}).values():
        reqs += group
    return [Requirement(r) for r in reqs]


@pytest.mark.parametrize("req", [r for r in _requirements() if r.extras], ids=str)
def test_every_requested_extra_exists(req):
    try:
        provided = md.metadata(req.name).get_all("Provides-Extra") or []
    except md.PackageNotFoundError:
        pytest.skip(f"{req.name} is not installed here")
    missing = sorted(e for e in req.extras if e not in provided)
    assert not missing, f"{req.name} {md.version(req.name)} has no extra {missing} (it has {provided})"


def test_math_verify_carries_no_extra():
    (mv,) = [r for r in _requirements() if r.name == "math-verify"]
    assert not mv.extras and mv.specifier.contains("0.9.0")
