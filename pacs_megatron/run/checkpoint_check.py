"""Is a checkpoint directory loadable? A cheap check run before every resume and every pruning.

A megatron ``torch_dist`` checkpoint lists every byte range it wrote in ``megatron/.metadata``
(torch.distributed.checkpoint's ``Metadata.storage_data``: item -> (file, offset, length)). So
"all shards present and readable" is checked without reading the shards: every listed file must
exist and be at least ``offset + length`` bytes long. That catches a deleted shard, a truncated
shard (a copy cut short, a full disk) and a missing ``.metadata``; it cannot catch bytes flipped
inside a shard (that would take reading every shard, i.e. a full load). The small files (the common
state ``common.pt``, ``metadata.json``, the trainer's ``extra_state.json``) are parsed in full, and so
are the small pickled objects inside the shards (RNG states): every pickle is read as data only
(run/checkpoint_data.py), so a tampered checkpoint is refused, with one line, before megatron loads it.
A critic or a KL reference policy saved beside the actor (:data:`OPTIONAL_DIRS`) is checked the same way.

Kept free of megatron imports, so the launcher can run it before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pacs_megatron.run.checkpoint_data import UnsafeCheckpoint, check_objects, load_common, read_metadata
from pacs_megatron.run.layout import DistLayout, StepLayout

MEGATRON_DIR = StepLayout(Path()).megatron.path.name
"""The actor's dist checkpoint's directory name, as the problems below name it (run/layout.py spells it)."""
EXTRA_STATE = StepLayout(Path()).extra_state.name
EXTRA_KEYS = ("step", "dataset")


def _optional(step: StepLayout) -> dict[str, DistLayout]:
    """Other dist checkpoints a step may hold, loaded on resume when present: a PPO run's critic
    (runtime.py) and the KL term's frozen reference policy (actor/reference.py)."""
    return {step.critic.name: StepLayout(step.critic).megatron, step.reference.path.name: step.reference}


def _shard_problem(megatron_dir: Path) -> str | None:
    if not DistLayout(megatron_dir).index.is_file():
        return f"{MEGATRON_DIR}/.metadata is missing"
    try:
        metadata = read_metadata(megatron_dir)
    except UnsafeCheckpoint as e:
        return str(e)
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
    try:
        check_objects(megatron_dir, metadata)
    except UnsafeCheckpoint as e:
        return str(e)
    except Exception as e:
        return f"a pickled object in the {MEGATRON_DIR}/ shards is unreadable ({type(e).__name__}: {e})"
    return None


def _common_problem(megatron_dir: Path) -> str | None:
    dist = DistLayout(megatron_dir)
    for path in (dist.metadata_json, dist.common):
        if not path.is_file():
            return f"{MEGATRON_DIR}/{path.name} is missing"
    try:
        json.loads(dist.metadata_json.read_text())
        load_common(megatron_dir)
    except UnsafeCheckpoint as e:
        return str(e)
    except Exception as e:
        return f"{MEGATRON_DIR}/common state is unreadable ({type(e).__name__}: {e})"
    return None


def read_extra_state(path: str | Path) -> dict:
    """The trainer's state saved with a checkpoint (step, data position, config, model shape)."""
    return json.loads(StepLayout(Path(path)).extra_state.read_text())


def _extra_problem(root: Path) -> str | None:
    if not StepLayout(root).extra_state.is_file():
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
    step = StepLayout(root)
    if not root.is_dir():
        return "the directory does not exist"
    if not step.megatron.path.is_dir():
        return f"{MEGATRON_DIR}/ is missing"
    problem = _extra_problem(root) or _megatron_problem(step.megatron.path)
    for name, dist in _optional(step).items():
        if problem is None and dist.path.is_dir():
            problem = _megatron_problem(dist.path)
            problem = problem and f"{name}: {problem}"
    return problem


def _megatron_problem(megatron_dir: Path) -> str | None:
    return _common_problem(megatron_dir) or _shard_problem(megatron_dir)


def parameter_dtype(path: str | Path) -> Any:
    """The dtype the model weights were saved in (read from ``.metadata``, no shard is opened)."""
    metadata = read_metadata(StepLayout(Path(path)).megatron.path)
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(("embedding.", "decoder.")) and hasattr(meta, "properties"):
            return meta.properties.dtype
    raise ValueError(f"{path}: no model weights listed in {MEGATRON_DIR}/.metadata")
