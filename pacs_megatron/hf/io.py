"""Hugging Face checkpoint files: lazy safetensors reading (one file or an index of shards) and a
streaming writer that keeps at most one shard in memory.

No torch.distributed here: the actor decides which rank reads and writes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


class SafetensorsReader:
    """``reader.get(name)`` reads one tensor from a HF model directory, opening each file lazily.

    Example:
        >>> r = SafetensorsReader("/ckpt/Qwen2.5-0.5B")              # doctest: +SKIP
        >>> r.get("model.embed_tokens.weight").shape                  # doctest: +SKIP
        torch.Size([151936, 896])
    """

    def __init__(self, model_dir: str | os.PathLike) -> None:
        root = Path(model_dir)
        if (root / INDEX).is_file():
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
            self.files = {name: root / f for name, f in weight_map.items()}
        elif (root / SINGLE).is_file():
            with safe_open(root / SINGLE, framework="pt") as f:
                self.files = {name: root / SINGLE for name in f.keys()}
        else:
            raise FileNotFoundError(
                f"model.path={str(root)!r} has neither {SINGLE} nor {INDEX}: point model.path at a Hugging Face "
                "checkpoint with safetensors weights, or use model.init=random"
            )
        self.root = root
        self._open: dict[Path, Any] = {}  # safetensors' safe_open handles

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        path = self.files.get(name)
        if path is None:
            raise KeyError(f"{self.root}: the checkpoint has no tensor {name!r}")
        handle = self._open.get(path)
        if handle is None:
            handle = self._open[path] = safe_open(path, framework="pt")
        return handle.get_tensor(name)

    def close(self) -> None:
        self._open.clear()


def _umask() -> int:
    """The process umask (read by setting it, then put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_safetensors(
    items: Iterable[tuple[str, torch.Tensor]], out_dir: str | os.PathLike, max_shard_bytes: int = 4 << 30
) -> list[str]:
    """Write (name, tensor) pairs as ``model.safetensors`` or, past ``max_shard_bytes``, as HF-style
    ``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[Path, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            path = out / f".part-{len(parts):05d}.safetensors"
            save_file(current, str(path), metadata={"format": "pt"})
            os.chmod(path, 0o666 & ~_umask())  # safetensors creates 0600 files: honour the umask as open() does
            parts.append((path, list(current)))
        current, size = {}, 0

    total = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    flush()
    if len(parts) == 1:
        os.replace(parts[0][0], out / SINGLE)
        return [SINGLE]
    names, weight_map = [], {}
    for k, (path, tensors) in enumerate(parts):
        final = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(path, out / final)
        names.append(final)
        weight_map.update(dict.fromkeys(tensors, final))
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def copy_tokenizer_files(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copy the tokenizer (and generation config) files that exist in ``src_dir``."""
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(src_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(dst_dir) / name)
            copied.append(name)
    return copied
