"""Process groups for the Megatron actor: start-up checks, megatron's parallel_state, CPU patches.

Only this package and ``actor/`` import megatron; the rest of the project sees :class:`ParallelGroups`.
The names below load on first use (PEP 562): :func:`check_layout` needs no torch, and the launcher's parent
process, which only checks the layout, never imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pacs_megatron.parallel.groups import ParallelGroups, destroy_parallel, init_distributed, initialize_parallel
    from pacs_megatron.parallel.layout import check_layout

_WHERE = {
    "ParallelGroups": "groups",
    "check_layout": "layout",
    "destroy_parallel": "groups",
    "init_distributed": "groups",
    "initialize_parallel": "groups",
}
__all__ = ["ParallelGroups", "check_layout", "destroy_parallel", "init_distributed", "initialize_parallel"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
