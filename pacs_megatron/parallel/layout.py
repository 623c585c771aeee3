"""Start-up checks of a parallel layout against the world and the model: config only, no torch, so the
launcher's parent process (``pacs-megatron train`` before it starts the ranks) checks a run without it."""

from __future__ import annotations

from typing import Any

from pacs_megatron.config import ConfigError, ParallelConfig


def check_layout(cfg: ParallelConfig, hf_config: Any, world_size: int | None = None, training: bool = True) -> None:
    """Start-up checks of the layout against the world and the model; ConfigError names the fix.

    ``hf_config`` is a transformers config or its config.json dict. ``training=False`` (the parity
    tool: forward passes only) allows MoE with TP > 1 without sequence parallelism.
    """
    get = hf_config.get if isinstance(hf_config, dict) else (lambda k, d=None: getattr(hf_config, k, d))
    if world_size is not None and world_size != cfg.world_size:
        replica = cfg.tp * cfg.pp * cfg.cp
        fix = (
            f"set parallel.dp={world_size // replica}"
            if world_size % replica == 0
            else f"parallel.tp * parallel.pp * parallel.cp = {replica} must divide it: change parallel.cp (or tp, pp)"
        )
        raise ConfigError(
            f"the job has {world_size} ranks but parallel.tp * parallel.pp * parallel.cp * parallel.dp = "
            f"{cfg.tp}*{cfg.pp}*{cfg.cp}*{cfg.dp} = {cfg.world_size}: {fix}, or launch that many ranks"
        )
    heads = int(get("num_attention_heads", 1))
    kv = int(get("num_key_value_heads", None) or heads)
    layers = int(get("num_hidden_layers", 1))
    if heads % cfg.tp:
        raise ConfigError(f"parallel.tp={cfg.tp} must divide the model's num_attention_heads={heads}")
    if kv % cfg.tp:
        raise ConfigError(
            f"parallel.tp={cfg.tp} must divide the model's num_key_value_heads={kv} (GQA groups are not replicated)"
        )
    if layers % (cfg.pp * cfg.vpp):
        raise ConfigError(
            f"parallel.pp * parallel.vpp = {cfg.pp}*{cfg.vpp} must divide the model's num_hidden_layers={layers}"
        )
    check_expert_layout(cfg, get, training)
    check_context_layout(cfg, get)
    if cfg.sequence_parallel and not _have_te_or_apex():
        raise ConfigError(
            "parallel.sequence_parallel=true needs Transformer Engine or NVIDIA Apex (fused norms): "
            "install one, or set parallel.sequence_parallel=false"
        )


def check_expert_layout(cfg: ParallelConfig, get, training: bool = True) -> None:
    """parallel.ep / tp against the model's experts (ConfigError naming the fields)."""
    # transformers 5 writes "num_local_experts" (an attribute_map alias); the Qwen checkpoints "num_experts"
    n = get("num_experts", None) or get("num_local_experts", None) or 0
    experts = int(n) if get("model_type", None) == "qwen3_moe" else 0
    if cfg.ep > 1 and experts == 0:
        raise ConfigError(f"parallel.ep={cfg.ep} needs a MoE model (model_type qwen3_moe): set parallel.ep=1")
    if experts and experts % cfg.ep:
        raise ConfigError(f"parallel.ep={cfg.ep} must divide the model's num_experts={experts}")
    if experts and training and cfg.tp > 1 and not cfg.sequence_parallel:
        # megatron-core's MoELayer raises in training mode under TP without sequence parallelism
        raise ConfigError(
            f"parallel.tp={cfg.tp} with a MoE model needs parallel.sequence_parallel=true (megatron-core trains MoE "
            "under TP only with it; it needs Transformer Engine or Apex): on CPU set parallel.tp=1 and split the "
            "experts with parallel.ep"
        )


def check_context_layout(cfg: ParallelConfig, get) -> None:
    """parallel.cp against the model (ConfigError naming the field); the sequence-length rules are
    parallel/cp_split.py's, checked per batch."""
    if cfg.cp == 1:
        return
    if get("model_type", None) == "qwen3_moe":
        # routing replay and the MoE padding mask index tokens in the unsplit order (actor/moe/routing.py)
        raise ConfigError(f"parallel.cp={cfg.cp} with a MoE model is not supported yet: set parallel.cp=1")


def _have_te_or_apex() -> bool:
    for name in ("transformer_engine.pytorch", "apex.normalization"):
        try:
            __import__(name)
            return True
        except Exception:  # ImportError, or TE failing without CUDA
            continue
    return False
