"""Which rollouts ``eval_rollout.jsonl`` holds: the key it was sampled under, and what differs now.

The key is everything that changes the sampled responses or their scores: the model (its path and
a fingerprint of config.json and the weight files' names, sizes and mtimes), the data (specs, the
files they resolve to with size and mtime, ``--limit``), ``n``, temperature, top_p, top_k, max tokens,
seed, chat template, tokenizer, max prompt length and the reward. It is saved beside the rollouts
(``eval_rollout.key.json``) and recorded in ``eval_metrics.json`` under ``"sampling"``; ``--k`` is
not part of it (pass@k for any k <= n is recomputed from the same rollouts).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def _stat(path: Path) -> list:
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


def model_fingerprint(model_dir: Path) -> str:
    """A short hash of config.json's bytes and the weight files' (name, size, mtime)."""
    h = hashlib.sha256()
    config = model_dir / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES) if model_dir.is_dir() else []:
        h.update(json.dumps(_stat(f)).encode())
    return h.hexdigest()[:16]


def data_fingerprint(specs: list[str], data_root: Path) -> list:
    """Per data spec: the spec, and the file it resolves to with size and mtime (when it resolves)."""
    from pacs_megatron.data.sources import resolve_dataset

    out = []
    for spec in specs:
        try:
            _, path = resolve_dataset(spec, data_root)
            out.append([spec, str(path.resolve()), *_stat(path)[1:]])
        except (FileNotFoundError, ValueError):
            out.append([spec])
    return out


def cache_key(args, model_dir: Path, data_root: Path) -> dict[str, Any]:
    """The key of the rollouts the eval arguments ``args`` would sample."""
    specs = [d.strip() for d in args.data.split(",") if d.strip()]
    return {
        "model": str(model_dir.resolve()),
        "model_fingerprint": model_fingerprint(model_dir),
        "data": specs,
        "data_files": data_fingerprint(specs, data_root),
        "limit": args.limit,
        "n": args.n,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "chat_template": args.chat_template,
        "shots": getattr(args, "shots", []),
        "tokenizer": str(Path(args.tokenizer or model_dir).resolve()),
        "max_prompt_length": args.max_prompt_length,
        "reward": args.reward,
        "engine": args.engine,
        # tool-integrated evaluation only: keys of single-turn runs stay as they were
        **(
            {"tool_turns": args.tool_turns, "tools": args.tools, "tool_instruction": args.tool_instruction}
            if getattr(args, "tool_turns", 0)
            else {}
        ),
    }


def key_path(rollout_path: Path) -> Path:
    return rollout_path.with_suffix(".key.json")


def read_key(rollout_path: Path) -> dict[str, Any] | None:
    """The key saved beside ``rollout_path``, or None (none saved, or unreadable)."""
    try:
        return json.loads(key_path(rollout_path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_key(rollout_path: Path, key: dict[str, Any]) -> None:
    key_path(rollout_path).write_text(json.dumps(key, indent=2) + "\n")


def differences(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """``["n: 4 -> 8", ...]`` for every key field that differs (engine excluded: same samples by design).

    Example:
        >>> differences({"n": 4, "seed": 0}, {"n": 8, "seed": 0})
        ['n: 4 -> 8']
    """
    if old is None:
        return ["no sampling settings recorded with these rollouts"]
    return [f"{k}: {_short(old.get(k))} -> {_short(v)}" for k, v in new.items() if k != "engine" and old.get(k) != v]


def _short(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, str) else v
    return text if len(text) <= 80 else text[:77] + "..."
