"""A checkpoint's pickles read as data: reading a checkpoint never runs code from it.

``megatron/common.pt``, ``megatron/.metadata`` and the byte items inside the ``*.distcp`` shards are pickles,
which may name any callable. Every read here refuses a global outside an allow-list, with one line naming
it: ``torch.load(weights_only=True)`` plus :data:`DATA_GLOBALS` (and megatron's own safe globals where it is
imported), and an Unpickler for ``.metadata`` that resolves only torch.distributed.checkpoint's classes.
Megatron's own load and Transformer Engine's FP8 state still unpickle fully: load only checkpoints you trust.
The three pickles and the trust boundary: docs/runs.md, "A checkpoint's pickles are read as data".
"""

from __future__ import annotations

import functools
import io
import pathlib
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from pacs_megatron.run.layout import DistLayout

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]

DATA_GLOBALS = [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)), io.BytesIO]
"""Allowed beyond torch's defaults in ``common.pt`` and byte items: numpy's RNG state (an array of
uint32); a BytesIO is older Transformer Engine's ``_extra_state`` (TE loads it with weights_only)."""
TRUST = "load only checkpoints you trust"


class UnsafeCheckpoint(ValueError):
    """A checkpoint file names code where data belongs; the message is one line."""


def _refuse(what: str, names: Iterable[str]) -> UnsafeCheckpoint:
    listed = ", ".join(sorted(names))
    return UnsafeCheckpoint(f"{what} holds pickled code ({listed}), not data: refused ({TRUST})")


def load_data(f: Path | io.BytesIO, what: str) -> Any:
    """``torch.load`` of a ``torch.save`` file or buffer that may hold only data; raises
    :class:`UnsafeCheckpoint` naming the globals it has beyond the allow-list."""
    import torch  # here, not at the top: export's --help and the checks of a run directory import no torch

    with torch.serialization.safe_globals(DATA_GLOBALS):
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(f)  # a static scan: runs nothing
        if unsafe:
            raise _refuse(what, unsafe)
        if isinstance(f, io.BytesIO):
            f.seek(0)
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # an opcode the scan does not list (weights_only refuses it)
            raise UnsafeCheckpoint(f"{what} is not plain data ({str(e).splitlines()[0]}): refused ({TRUST})") from None


def load_common(megatron_dir: str | Path) -> dict:
    """``megatron/common.pt`` (layout, scheduler, counters) as data."""
    common = DistLayout(Path(megatron_dir)).common
    return load_data(common, f"{common.parent.name}/{common.name}")


@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    import torch
    from torch.distributed.checkpoint import filesystem, metadata, planner

    names = {
        metadata: ("Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
                   "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"),
        planner: ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"),
        filesystem: ("_StorageInfo",),
    }  # fmt: skip
    allowed: dict[tuple[str, str], Any] = {(m.__name__, n): getattr(m, n) for m, ns in names.items() for n in ns}
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath  # StorageMeta.checkpoint_id of dcp.save(checkpoint_id=...)
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # name -> torch.layout
    allowed.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes of torch.distributed.checkpoint's metadata (dataclasses and enums)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_globals().get((module, name))
        if found is None:
            raise _refuse("megatron/.metadata", [f"{module}.{name}"])
        return found


def read_metadata(megatron_dir: str | Path) -> Any:
    """torch.distributed.checkpoint's ``Metadata`` from ``megatron/.metadata``, unpickled as data
    (what ``FileSystemReader.read_metadata`` returns, without its ``pickle.load``)."""
    with open(DistLayout(Path(megatron_dir)).index, "rb") as f:
        return _MetadataUnpickler(f).load()


def check_objects(megatron_dir: str | Path, metadata: Any) -> None:
    """Load every byte item (megatron's ShardedObjects) listed in ``metadata`` as data; raises
    :class:`UnsafeCheckpoint` for the first that is not. The shards must be present and long enough."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    root = Path(megatron_dir)
    for index, info in sorted((metadata.storage_data or {}).items(), key=lambda kv: kv[0].fqn):
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        what = f"megatron/{info.relative_path} item {index.fqn}"
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpoint(f"{what} is encoded ({info.transform_descriptors}), which this check cannot read")
        with open(root / info.relative_path, "rb") as f:
            f.seek(info.offset)
            load_data(io.BytesIO(f.read(info.length)), what)
