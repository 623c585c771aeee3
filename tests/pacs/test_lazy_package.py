"""pacs/__init__.py loads its names lazily (PEP 562), so that the config layer reads pacs/config.py without
torch. A name that is also a submodule's would be shadowed by the submodule once anything imports it (the
package attribute Python sets on import wins over ``__getattr__``): none may be."""

from __future__ import annotations

import pkgutil

import pacs_megatron.pacs as pacs


def test_no_exported_name_is_also_a_submodule():
    submodules = {m.name for m in pkgutil.iter_modules(pacs.__path__)}
    assert not set(pacs._HOME) & submodules
    assert set(pacs.__all__) == set(pacs._HOME)


def test_every_name_resolves_to_what_its_module_defines():
    import importlib

    for name, module in pacs._HOME.items():
        assert getattr(pacs, name) is getattr(importlib.import_module(f"pacs_megatron.pacs.{module}"), name)
