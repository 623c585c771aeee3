"""The model's shape: :class:`ModelSpec`, the architecture facts read once from a Hugging Face config.json
(Qwen2 / Qwen2.5, Llama 3, Qwen3, Qwen3-MoE), validated (:func:`model_spec_from_hf`). No megatron: the formats
(hf/convert.py, hf/io.py) and the actor (actor/model.py builds a GPTModel from it) both read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pacs_megatron.config import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the actor needs, read once from the HF config.

    Example:
        >>> from transformers import Qwen2Config
        >>> s = model_spec_from_hf(Qwen2Config(vocab_size=255, hidden_size=64, num_attention_heads=4,
        ...     num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128), tp=2)
        >>> s.head_dim, s.padded_vocab_size, s.qkv_bias
        (16, 256, True)
    """

    model_type: str
    """One of SUPPORTED_MODEL_TYPES."""
    vocab_size: int
    """HF vocabulary rows (embedding and LM-head rows in the checkpoint)."""
    padded_vocab_size: int
    """vocab_size rounded up to a multiple of TP (megatron's vocab-parallel layers split evenly)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    """None, or the "llama3" scaling parameters."""
    tie_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    initializer_range: float
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_ffn_hidden_size: int = 0
    """SwiGLU width of one expert."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (else: softmax over all experts)."""
    moe_layers: tuple[int, ...] = ()
    """0-based indices of the layers whose MLP is a MoE layer (the others are dense)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _rope_params(hf: Any) -> tuple[float, dict | None]:
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type", params.get("type", "default")) if params else "default"
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, params
    raise ConfigError(
        f"model config rope type {kind!r} is not supported by the Megatron actor: supported are the default "
        "RoPE and 'llama3' scaling"
    )


def model_spec_from_hf(hf: Any, tp: int = 1) -> ModelSpec:
    """Validate a transformers config and extract a :class:`ModelSpec` (ConfigError when unsupported)."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model.path holds a {model_type!r} model ({getattr(hf, 'architectures', None)}): the Megatron actor "
            f"supports {list(SUPPORTED_MODEL_TYPES)} (Qwen2/Qwen2.5, Llama 3)"
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ConfigError(f"model hidden_act={hf.hidden_act!r}: only silu (SwiGLU) is supported")
    if getattr(hf, "use_sliding_window", False):
        raise ConfigError("model use_sliding_window=true: sliding-window attention is not supported")
    if model_type == "llama" and (getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False)):
        raise ConfigError("Llama with attention_bias/mlp_bias is not supported (megatron cannot bias o_proj alone)")
    theta, scaling = _rope_params(hf)
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    moe = _moe_fields(hf) if model_type == "qwen3_moe" else {}
    return ModelSpec(
        model_type=model_type,
        vocab_size=hf.vocab_size,
        padded_vocab_size=-(-hf.vocab_size // tp) * tp,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_hidden_size=hf.intermediate_size,
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        max_position_embeddings=hf.max_position_embeddings,
        initializer_range=float(getattr(hf, "initializer_range", 0.02)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **moe,
    )


def _moe_fields(hf: Any) -> dict:
    """Qwen3-MoE's expert fields; a layer is sparse when it is not in ``mlp_only_layers`` and
    ``(layer + 1) % decoder_sparse_step == 0`` (transformers' rule)."""
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    dense_only = set(getattr(hf, "mlp_only_layers", None) or [])
    layers = tuple(i for i in range(hf.num_hidden_layers) if i not in dense_only and (i + 1) % step == 0)
    if int(hf.num_experts) <= 0 or not layers:
        raise ConfigError("a qwen3_moe model with num_experts=0 or no sparse layer: convert it as a dense qwen3")
    if int(hf.num_experts_per_tok) > int(hf.num_experts):
        raise ConfigError(f"model num_experts_per_tok={hf.num_experts_per_tok} exceeds num_experts={hf.num_experts}")
    return {
        "num_experts": int(hf.num_experts),
        "num_experts_per_tok": int(hf.num_experts_per_tok),
        "moe_ffn_hidden_size": int(hf.moe_intermediate_size),
        "norm_topk_prob": bool(getattr(hf, "norm_topk_prob", False)),
        "moe_layers": layers,
    }
