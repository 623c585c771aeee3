"""What may change when a run resumes, and what may not.

A checkpoint's ``extra_state.json`` records the run's resolved config and the model's shape; on resume the
new config is compared with it. The loop's settings change at once (listed as a diff), the parallel layout
may change (resharded on load), but the model's shape and vocabulary, LoRA's settings and a LoRA
checkpoint's base (:func:`check_lora_base`) may not, nor may ``model.tiny.*`` disagree with an existing
config.json (:func:`check_tiny_model_dir`). Small files only and no megatron, so a launcher runs
:func:`preflight_resume` before any rank starts. The list: docs/runs.md, "What may change when a run resumes".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pacs_megatron.config import ConfigError, RunConfig
from pacs_megatron.run.checkpoint import CheckpointManager, _from_rank0, _rank
from pacs_megatron.run.checkpoint_base import base_problem, describe_base, lora_record
from pacs_megatron.run.checkpoint_check import read_extra_state

# HF config keys that fix the weights' shapes (max_position_embeddings does not: RoPE has no table).
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)
# model.tiny.* field -> the config.json key it writes.
TINY_KEYS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
    "architecture": "model_type",  # qwen2 | qwen3 | qwen3_moe are the model_type strings
}
TINY_MOE_KEYS = {"num_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok"}
# Keys that describe the launch, not the run: never reported as changes.
LAUNCH_KEYS = ("trainer.resume", "trainer.dry_run", "trainer.overwrite")


@dataclass
class ResumePlan:
    """The checkpoint a launch resumes from and how its config differs from the checkpoint's."""

    path: Path
    """The validated checkpoint directory."""
    step: int
    """Its last completed step."""
    changes: list[str] = field(default_factory=list)
    """"key: old -> new" for every setting that changed since the checkpoint."""


def model_shape(hf_config: dict) -> dict:
    """The shape-defining part of a HF config.json (saved with every checkpoint)."""
    return {k: hf_config.get(k) for k in SHAPE_KEYS}


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(old: dict, new: dict) -> list[str]:
    """``"key: old -> new"`` for every leaf that differs (launch-only keys left out).

    Example:
        >>> config_changes({"optimizer": {"lr": 0.001}, "seed": 1}, {"optimizer": {"lr": 0.5}, "seed": 1})
        ['optimizer.lr: 0.001 -> 0.5']
    """
    a, b = _flatten(old), _flatten(new)
    keys = sorted((set(a) | set(b)) - set(LAUNCH_KEYS))
    return [f"{k}: {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}" for k in keys if a.get(k) != b.get(k)]


def check_model_unchanged(saved_shape: dict | None, hf_config: dict, path: str | Path) -> None:
    """Raise ConfigError when the model's shape or vocabulary differs from the checkpoint's."""
    if not saved_shape:
        return  # checkpoints written before the shape was recorded
    now = model_shape(hf_config)
    diff = [f"{k} {saved_shape.get(k)} -> {now.get(k)}" for k in SHAPE_KEYS if saved_shape.get(k) != now.get(k)]
    if diff:
        raise ConfigError(
            f"cannot resume from {path}: the model differs from the checkpoint's ({'; '.join(diff)}); the model "
            "shape and vocabulary cannot change on resume: point model.path (and model.tiny.*) back at the "
            "checkpoint's model, or start a fresh run (a new trainer.output_dir, or --resume never --overwrite)"
        )


def check_tiny_model_dir(cfg: RunConfig) -> None:
    """``model.init=tiny`` with an existing ``model.path/config.json``: it must match ``model.tiny.*``."""
    config_json = Path(cfg.model.path) / "config.json"
    if cfg.model.init != "tiny" or not config_json.is_file():
        return
    hf = json.loads(config_json.read_text())
    diff = [
        f"model.tiny.{k}={getattr(cfg.model.tiny, k)} but config.json has {key}={hf.get(key)}"
        for k, key in (TINY_KEYS | (TINY_MOE_KEYS if cfg.model.tiny.architecture == "qwen3_moe" else {})).items()
        if hf.get(key) != getattr(cfg.model.tiny, k)
    ]
    if diff:
        raise ConfigError(
            f"model.path={cfg.model.path} already holds a different tiny model ({'; '.join(diff)}): use a new "
            "model.path for this shape, or drop the model.tiny overrides"
        )


def check_lora_unchanged(saved_config: dict | None, cfg: RunConfig, path: str | Path) -> None:
    """Raise ConfigError when the adapters asked for differ from the checkpoint's (actor.lora rank or targets):
    its weights hold other tensors, so the load would fail deep in megatron, or train other parameters."""
    saved = ((saved_config or {}).get("actor") or {}).get("lora") or {}
    was = (int(saved.get("rank", 0)), sorted(saved.get("targets") or []) if saved.get("rank") else [])
    now = (cfg.actor.lora.rank, sorted(cfg.actor.lora.targets) if cfg.actor.lora.enabled else [])
    if was != now:
        show = lambda r, t: f"actor.lora.rank={r}" + (f" targets={t}" if r else "")  # noqa: E731
        raise ConfigError(
            f"cannot resume from {path}: it was trained with {show(*was)}, this run asks for {show(*now)}; resume "
            "with the checkpoint's settings, or start a new run (trainer.resume=never, another output_dir)"
        )


def check_lora_base(extra: dict, cfg: RunConfig, path: str | Path) -> None:
    """Collective: a checkpoint holding only LoRA adapters resumes on the base it was trained on, else one
    line naming the path, both hashes and the fix. Rank 0 hashes the base (once per process: the actor's
    checkpoint load reuses it) and tells the others, before anything heavy is built."""
    record = lora_record(extra)
    if not record or not record.get("adapters_only"):
        return
    problem = None
    if _rank() == 0:
        import torch  # here only: a random base depends on the device it is drawn on

        p, m = cfg.parallel, cfg.model
        layout = {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "ep": p.ep}
        try:
            now = describe_base(m.init, m.path, m.seed, layout, torch.cuda.is_available())
            problem = base_problem(record, now, path)
        except (OSError, ValueError) as e:
            problem = f"cannot resume from {path}: it holds LoRA adapters, not their base, which cannot be read ({e})"
    problem = _from_rank0(problem)
    if problem:
        raise ConfigError(problem)


def plan_resume(cfg: RunConfig, config_dict: dict, hf_config: dict) -> ResumePlan | None:
    """Collective: the checkpoint to resume from (damaged ones moved aside, see CheckpointManager),
    refused when the model changed; None for a fresh run."""
    mgr = CheckpointManager(cfg.trainer.output_dir, cfg.trainer.keep_checkpoints)
    path = mgr.resolve(cfg.trainer.resume)
    if path is None:
        return None
    extra = read_extra_state(path)
    check_model_unchanged(extra.get("model"), hf_config, path)
    check_lora_unchanged(extra.get("config"), cfg, path)
    check_lora_base(extra, cfg, path)
    changes = config_changes(extra["config"], config_dict) if "config" in extra else []
    return ResumePlan(path, int(extra["step"]), changes)


def preflight_resume(cfg: RunConfig) -> None:
    """Launcher-side (no ranks, nothing moved): the tiny model dir and the newest checkpoint's model
    shape must match this config. Raises ConfigError."""
    check_tiny_model_dir(cfg)
    config_json = Path(cfg.model.path) / "config.json"
    if cfg.trainer.resume == "never" or not config_json.is_file():
        return
    mgr = CheckpointManager(cfg.trainer.output_dir)
    path = mgr.latest() if cfg.trainer.resume == "auto" else Path(cfg.trainer.resume)
    if path is not None and (path / "extra_state.json").is_file():
        try:
            extra = read_extra_state(path)
        except ValueError:
            return  # damaged: the ranks fall back to an older checkpoint and say so
        check_model_unchanged(extra.get("model"), json.loads(config_json.read_text()), path)
        check_lora_unchanged(extra.get("config"), cfg, path)
