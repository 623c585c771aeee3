"""Bad inputs every command must turn into one line and exit 2: a tiny real Hugging Face model and the
ways a user's copy of one goes wrong, and a read-only directory that is read-only for root too."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from pacs_megatron.config import TinyModelConfig

TINY = TinyModelConfig(hidden_size=16, num_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)


def make_hf_model(path: Path) -> Path:
    """A complete tiny Qwen2 (config.json, model.safetensors, the arith tokenizer) at ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pacs_megatron.data.synthetic import write_tiny_model_dir

    write_tiny_model_dir(path, TINY)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model.save_pretrained(path)
    return path


def broken_models(good: Path, root: Path) -> dict[str, Path]:
    """Copies of ``good``, each damaged one way: name -> directory."""
    out = {}
    for name in ("no_weights", "no_tokenizer", "truncated", "mismatch", "bad_json"):
        d = root / name
        shutil.copytree(good, d)
        out[name] = d
    (out["no_weights"] / "model.safetensors").unlink()  # a run's model/ folder: config + tokenizer only
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out["no_tokenizer"] / f).unlink()
    weights = out["truncated"] / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size - 100)  # an interrupted download
    cfg = json.loads((good / "config.json").read_text())
    (out["mismatch"] / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3, "hidden_size": 32}))
    (out["bad_json"] / "config.json").write_text('{"model_type": "qwen2",\n "hidden_size": 16,,}')
    return out


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    """``mount -t tmpfs -o OPTIONS`` at ``path`` for the block; yields None where it cannot be mounted."""
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only_dir(path: Path):
    """A directory no write reaches: a read-only tmpfs when root (root ignores permission bits), else
    mode 0555. Yields None where neither can be made (the caller skips)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    with _tmpfs(path, "ro,size=64k") as mounted:
        yield mounted


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of ``size`` (e.g. "1m") at ``path``: a real full disk. Yields None where it cannot be
    mounted (not root, or no mount privilege; the caller skips)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        yield None
        return
    with _tmpfs(path, f"size={size}") as mounted:
        yield mounted
