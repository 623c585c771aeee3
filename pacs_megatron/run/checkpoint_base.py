"""The base model under a LoRA checkpoint: what it is, a hash of its weights, and the check before a resume.

A LoRA checkpoint holds the adapters, not the frozen base: its ``extra_state.json`` names the base under
:data:`LORA_KEY` (init, path, sha256) with the ``merges`` of every PACS v2 reset folded into it. The hash
(:func:`describe_base`) is of the stored tensors (names, dtypes, shapes, bytes), not the files' bytes, or for
a random base of what draws it (config, seed, device, layout). No megatron and no torch here: a resume and
an export check the base before any model is built. Details: docs/runs.md, "The base model under a LoRA
checkpoint".
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LORA_KEY = "lora"
"""The key of a LoRA checkpoint's record in ``extra_state.json``."""
WEIGHT_INITS = ("pretrained", "gguf")
"""``model.init`` values whose base is read from ``model.path``'s safetensors (the others draw it)."""
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
_CHUNK = 1 << 24


@dataclass(frozen=True)
class BaseModel:
    """A run's base model, as a LoRA checkpoint names it."""

    init: str
    """``model.init`` it was built with."""
    path: str
    """``model.path``."""
    sha256: str
    """The hash of its weights (module docstring)."""
    source: str
    """What was hashed, for people."""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def _weight_files(root: Path) -> list[Path]:
    """The safetensors files the actor reads (hf/io.py): the index's shards, or model.safetensors."""
    if (root / INDEX).is_file():
        return sorted({root / f for f in json.loads((root / INDEX).read_text())["weight_map"].values()})
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    raise FileNotFoundError(f"model.path={str(root)!r} has neither {SINGLE} nor {INDEX}: no base weights to hash")


def _tensor_digests(path: Path) -> Iterator[tuple[str, str]]:
    """(name, sha256 of dtype, shape and bytes) of every tensor of one safetensors file, read in file order."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, end = info["data_offsets"]
            h = hashlib.sha256(f"{info['dtype']}{info['shape']}".encode())
            f.seek(8 + n + start)
            left = end - start
            while left > 0:
                block = f.read(min(_CHUNK, left))
                if not block:
                    raise ValueError(f"{path} is truncated: tensor {name} ends at byte {8 + n + end}")
                h.update(block)
                left -= len(block)
            yield name, h.hexdigest()


@functools.lru_cache(maxsize=8)
def _weights_sha256(files: tuple[Path, ...], stamp: tuple) -> str:
    """The tensors' hash, cached per process on the files' (size, mtime): a run hashes its base once."""
    del stamp  # part of the cache key only
    digests = sorted(d for f in files for d in _tensor_digests(f))
    return hashlib.sha256(json.dumps(digests).encode()).hexdigest()


def describe_base(init: str, path: str, seed: int, layout: Mapping[str, int], on_gpu: bool) -> BaseModel:
    """The base a run with these ``model.*`` settings builds (its hash computed here, see the module
    docstring). ``layout``: the run's ``tp``, ``pp``, ``vpp`` and ``ep`` (only a random base depends on it)."""
    root = Path(path)
    if init in WEIGHT_INITS:
        files = tuple(_weight_files(root))
        stamp = tuple((f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        source = f"the tensors of {', '.join(f.name for f in files)}"
        return BaseModel(init, str(path), _weights_sha256(files, stamp), source)
    # drawn at random: the config, the seed, the device, and the layout the draw depends on there
    config = root / "config.json"
    config_sha = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else "none"
    keys = ("tp", "pp", "vpp", "ep") if on_gpu else ("pp", "vpp")  # CPU draws full tensors: TP-free
    drawn = {k: int(layout.get(k, 1)) for k in keys}
    recipe = {"init": init, "seed": int(seed), "config.json": config_sha, "device": "cuda" if on_gpu else "cpu"}
    recipe.update(drawn)
    where = " ".join(f"{k}={v}" for k, v in drawn.items())
    source = f"model.init={init}: config.json, model.seed={seed}, drawn on {recipe['device']} at {where}"
    return BaseModel(init, str(path), hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest(), source)


def lora_record(extra: Mapping[str, Any] | None) -> dict | None:
    """The LoRA record of a checkpoint's extra state, or None (no LoRA, or a checkpoint from before the
    record: those hold the whole model)."""
    record = (extra or {}).get(LORA_KEY)
    return record if isinstance(record, dict) else None


def base_problem(record: Mapping[str, Any], now: BaseModel, ckpt: str | Path) -> str | None:
    """Why this run's base cannot carry the adapters of the checkpoint at ``ckpt`` (one line naming the
    path, both hashes and the fix), or None. A checkpoint that holds its base whole needs no check."""
    if not record.get("adapters_only"):
        return None
    saved = record.get("base") or {}
    if saved.get("sha256") == now.sha256:
        return None
    return (
        f"cannot resume from {ckpt}: its LoRA adapters were trained on the base at {saved.get('path')} "
        f"(sha256 {str(saved.get('sha256'))[:16]}, {saved.get('source')}), but model.path={now.path} gives sha256 "
        f"{now.sha256[:16]} ({now.source}); point model.path (and model.init / model.seed) at the checkpoint's "
        "base model, or start a new run (trainer.resume=never, another trainer.output_dir)"
    )


def export_base_problem(extra: Mapping[str, Any], ckpt: str | Path, model_dir: str, tp: int, pp: int) -> str | None:
    """``pacs-megatron export`` of an adapter-only LoRA checkpoint ``ckpt`` (``extra``: its extra state): why
    the base in ``model_dir``, built at ``tp`` x ``pp`` without virtual stages, is not its base, or None.
    Before any rank starts."""
    record = lora_record(extra)
    if not record or not record.get("adapters_only"):
        return None
    model = (extra.get("config") or {}).get("model") or {}
    init = str((record.get("base") or {}).get("init") or model.get("init", "pretrained"))
    on_gpu = False
    if init not in WEIGHT_INITS:  # a random base depends on the device it is drawn on
        import torch  # here only: the files' hash needs none

        on_gpu = torch.cuda.is_available()
    try:
        now = describe_base(init, model_dir, int(model.get("seed", 0)), {"tp": tp, "pp": pp}, on_gpu)
    except (OSError, ValueError) as e:
        return f"cannot export {ckpt}: it holds LoRA adapters, not their base, and the base cannot be read ({e})"
    problem = base_problem(record, now, ckpt)
    return problem.replace("cannot resume from", "cannot export", 1) if problem else None
