"""Is a checkpoint directory loadable? A cheap check run before every resume and every pruning.

A megatron ``torch_dist`` checkpoint lists every byte range it wrote in ``megatron/.metadata``
(torch.distributed.checkpoint's ``Metadata.storage_data``: item -> (file, offset, length)). So
"all shards present and readable" is checked without reading the shards: every listed file must
exist and be at least ``offset + length`` bytes long. That catches a deleted shard, a truncated
shard (a copy cut short, a full disk) and a missing ``.metadata``; it cannot catch bytes flipped
inside a shard (that would take reading every shard, i.e. a full load). The small files (the common
state ``common.pt``, ``metadata.json``, the trainer's ``extra_state.json``) are parsed in full.

Kept free of megatron imports, so the launcher can run it before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path

MEGATRON_DIR = "megatron"
EXTRA_STATE = "extra_state.json"
EXTRA_KEYS = ("step", "dataset")


def _shard_problem(megatron_dir: Path) -> str | None:
    from torch.distributed.checkpoint import FileSystemReader

    if not (megatron_dir / ".metadata").is_file():
        return f"{MEGATRON_DIR}/.metadata is missing"
    try:
        metadata = FileSystemReader(str(megatron_dir)).read_metadata()
    except Exception as e:  # unpickling a damaged file raises anything
        return f"{MEGATRON_DIR}/.metadata is unreadable ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    if not needed:
        return f"{MEGATRON_DIR}/.metadata lists no shard files"
    for name, size in sorted(needed.items()):
        f = megatron_dir / name
        if not f.is_file():
            return f"shard {MEGATRON_DIR}/{name} is missing"
        have = f.stat().st_size
        if have < size:
            return f"shard {MEGATRON_DIR}/{name} is truncated ({have} of {size} bytes)"
    return None


def _common_problem(megatron_dir: Path) -> str | None:
    import torch

    for name in ("metadata.json", "common.pt"):
        if not (megatron_dir / name).is_file():
            return f"{MEGATRON_DIR}/{name} is missing"
    try:
        json.loads((megatron_dir / "metadata.json").read_text())
        # Our own file (scheduler, counters, layout): plain Python objects, so weights_only is too strict.
        torch.load(megatron_dir / "common.pt", map_location="cpu", weights_only=False)
    except Exception as e:
        return f"{MEGATRON_DIR}/common state is unreadable ({type(e).__name__}: {e})"
    return None


def read_extra_state(path: str | Path) -> dict:
    """The trainer's state saved with a checkpoint (step, data position, config, model shape)."""
    return json.loads((Path(path) / EXTRA_STATE).read_text())


def _extra_problem(root: Path) -> str | None:
    if not (root / EXTRA_STATE).is_file():
        return f"{EXTRA_STATE} is missing"
    try:
        extra = read_extra_state(root)
    except (OSError, ValueError) as e:
        return f"{EXTRA_STATE} is unreadable ({e})"
    missing = [k for k in EXTRA_KEYS if k not in extra]
    return f"{EXTRA_STATE} lacks {missing}" if missing else None


def checkpoint_problem(path: str | Path) -> str | None:
    """What is wrong with the checkpoint at ``path`` (a ``step_XXXXXXXX`` directory), or None.

    Example:
        >>> checkpoint_problem("/nonexistent/step_00000001")
        'the directory does not exist'
    """
    root = Path(path)
    if not root.is_dir():
        return "the directory does not exist"
    if not (root / MEGATRON_DIR).is_dir():
        return f"{MEGATRON_DIR}/ is missing"
    return _extra_problem(root) or _common_problem(root / MEGATRON_DIR) or _shard_problem(root / MEGATRON_DIR)


def parameter_dtype(path: str | Path):
    """The dtype the model weights were saved in (read from ``.metadata``, no shard is opened)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(Path(path) / MEGATRON_DIR)).read_metadata()
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(("embedding.", "decoder.")) and hasattr(meta, "properties"):
            return meta.properties.dtype
    raise ValueError(f"{path}: no model weights listed in {MEGATRON_DIR}/.metadata")
