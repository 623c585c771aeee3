"""The engines' interfaces (rollout/base.py): traits validated when built, optional abilities checked with
isinstance, and no engine or actor capability read by name anywhere in the package (issue 60, R1)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pacs_megatron.rollout.base import AdapterReceiver, ChecksumReader, EngineTraits
from pacs_megatron.weight_sync.adapter import AdapterSync

PACKAGE = Path(__file__).resolve().parents[2] / "pacs_megatron"


def test_traits_name_a_replica_out_of_range():
    assert EngineTraits(replica=1, replicas=2).replica == 1
    with pytest.raises(ValueError, match=r"EngineTraits.replica=2 must be in \[0, replicas=2\)"):
        EngineTraits(replica=2, replicas=2)


class _Plain:
    def traits(self) -> EngineTraits:
        return EngineTraits()


class _Reader(_Plain):
    def weight_checksums(self):
        return None


class _AdapterEngine(_Plain):
    def __init__(self, serves: bool) -> None:
        self.serves = serves

    def traits(self) -> EngineTraits:
        return EngineTraits(serves_adapters=self.serves)

    def load_adapter(self, path: str, adapter_id: int, name: str) -> None: ...


def test_optional_abilities_are_protocols_and_adapters_need_the_trait_too(tmp_path):
    assert isinstance(_Reader(), ChecksumReader) and not isinstance(_Plain(), ChecksumReader)
    assert isinstance(_AdapterEngine(False), AdapterReceiver) and not isinstance(_Plain(), AdapterReceiver)
    with pytest.raises(ValueError, match="_AdapterEngine serves no LoRA adapter"):
        AdapterSync(object(), _AdapterEngine(serves=False), None)  # can load one, but was not built to serve


def _names(node: ast.AST) -> list[str]:
    """The identifiers an expression is built from (``self.engine`` -> self, engine), not its strings."""
    return [
        n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute)
    ]


def _reads_by_name(source: str) -> list[str]:
    """``getattr`` / ``hasattr`` calls whose object is an engine or an actor, as written."""
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    by_name = [c for c in calls if c.func.id in ("getattr", "hasattr") and c.args]
    return [ast.unparse(c) for c in by_name if any("engine" in n or "actor" in n for n in _names(c.args[0]))]


def test_no_engine_or_actor_capability_is_read_by_name():
    source = 'x = getattr(engine, "dp_rank", 0) + hasattr(self.actor, "reference") + getattr(cfg, "actor")'
    assert _reads_by_name(source) == ["getattr(engine, 'dp_rank', 0)", "hasattr(self.actor, 'reference')"]
    found = {str(p.relative_to(PACKAGE)): r for p in PACKAGE.rglob("*.py") if (r := _reads_by_name(p.read_text()))}
    assert not found, f"declare it in EngineTraits or a protocol (rollout/base.py, weight_sync/policy.py): {found}"
