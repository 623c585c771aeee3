"""Hugging Face <-> Megatron weight layouts, both ways, as pure tensor functions plus the walk over a rank.

Legend: H hidden, V HF vocab, Vp padded vocab (multiple of tp), nq query heads, ng KV heads (query
groups), rep = nq / ng, hd head dim, I ffn width, tp / r TP size / rank. docs/layout_conversion.md
has the pictures.

kinds (one per megatron parameter):
    "rep"    norms: replicated, copied as is
    "vocab"  embedding / LM head [Vp/tp, H]: rows r*Vp/tp..; the last rank's padding rows are zero
    "row"    row-parallel linear (o_proj, down_proj) [H, in/tp]: split along the input dim
    "qkv_w"  fused QKV [ng/tp * (rep+2) * hd, H]: per KV group g, rows [q heads of g | k_g | v_g];
             rank r holds groups r*ng/tp .. (r+1)*ng/tp
    "qkv_b"  the same for the qkv bias (Qwen2)
    "fc1"    SwiGLU fc1 [2*I/tp, H] = [gate rows of r; up rows of r] (megatron chunks the local output
             in two: act(first half) * second half)
    "expert_fc1", "expert"   Qwen3-MoE experts, whole on the EP rank that holds them (convert_moe.py)

Qwen3's q/k RMSNorm weights ([hd], shared by all heads) are "rep".

Every conversion here is slicing and concatenation, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pacs_megatron.hf.convert_moe import (
    EXPERT_KINDS,
    expert_hf_from_shard,
    expert_shard_from_hf,
    moe_export_rules,
    moe_hf_shapes,
    moe_layer_rule,
)
from pacs_megatron.hf.spec import ModelSpec

_LAYER = "model.layers.{l}."
# megatron suffix inside decoder.layers.{i}. -> (kind, HF suffixes inside model.layers.{l}.)
_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("rep", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("rep", ("input_layernorm.weight",)),  # TE fused norm
    "self_attention.linear_qkv.weight": (
        "qkv_w",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv_b",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.q_layernorm.weight": ("rep", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("rep", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("rep", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("rep", ("post_attention_layernorm.weight",)),  # TE fused norm
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ParamMap:
    """One megatron parameter of a model chunk and the HF tensors it is made of."""

    name: str
    """Parameter name inside the chunk (``decoder.layers.0.mlp.linear_fc1.weight``)."""
    kind: str
    """Layout kind (module docstring)."""
    hf_names: tuple[str, ...]
    """HF tensors, in the order the kind expects (q, k, v / gate, up)."""
    expert: int = -1
    """Global expert index of a MoE expert parameter; -1 otherwise."""


# --------------------------------------------------------------------------- pure layout functions


def _qkv_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[nq*hd, ...], [ng*hd, ...], [ng*hd, ...] -> [ng, (rep+2)*hd, ...] (megatron's group order)."""
    ng, hd = spec.num_kv_heads, spec.head_dim
    rest = q.shape[1:]
    q = q.reshape(ng, (spec.num_heads // ng) * hd, *rest)
    return torch.cat([q, k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)], dim=1)


def shard_from_hf(kind: str, hf: list[torch.Tensor], spec: ModelSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's megatron shard of one parameter from its full HF tensors."""
    if kind in EXPERT_KINDS:
        return expert_shard_from_hf(kind, hf)
    if kind == "rep":
        return hf[0]
    if kind == "vocab":
        w = hf[0]
        per = spec.padded_vocab_size // tp_size
        out = w.new_zeros((per, *w.shape[1:]))
        start = tp_rank * per
        rows = w[start : min(start + per, spec.vocab_size)]
        out[: rows.shape[0]] = rows
        return out
    if kind == "row":
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if kind in ("qkv_w", "qkv_b"):
        q, k, v = hf
        grouped = _qkv_grouped(q, k, v, spec)
        return grouped.chunk(tp_size, dim=0)[tp_rank].reshape(-1, *grouped.shape[2:])
    if kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    raise ValueError(f"unknown layout kind {kind!r}")


def hf_from_shards(kind: str, shards: list[torch.Tensor], spec: ModelSpec) -> list[torch.Tensor]:
    """The full HF tensors of one parameter from its shards in TP-rank order (inverse of shard_from_hf).

    With one shard (TP=1) no copy is made: the results may be views of the shard."""

    def cat(dim: int) -> torch.Tensor:
        return shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)

    if kind in EXPERT_KINDS:  # never TP-split: any shard is the whole tensor
        return expert_hf_from_shard(kind, shards[0])
    if kind == "rep":
        return [shards[0]]
    if kind == "vocab":
        return [cat(0)[: spec.vocab_size]]
    if kind == "row":
        return [cat(1)]
    if kind in ("qkv_w", "qkv_b"):
        ng, hd, rep = spec.num_kv_heads, spec.head_dim, spec.num_heads // spec.num_kv_heads
        full = cat(0)
        rest = full.shape[1:]
        grouped = full.reshape(ng, (rep + 2) * hd, *rest)
        q, k, v = grouped.split([rep * hd, hd, hd], dim=1)
        return [q.reshape(ng * rep * hd, *rest), k.reshape(ng * hd, *rest), v.reshape(ng * hd, *rest)]
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        if len(halves) == 1:
            return list(halves[0])
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise ValueError(f"unknown layout kind {kind!r}")


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor of the model (for receive buffers), in export order."""
    H, hd, I = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size  # noqa: E741
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, H)}
    for layer in range(spec.num_layers):
        p = _LAYER.format(l=layer)
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "self_attn.q_proj.weight"] = (q, H)
        out[p + "self_attn.k_proj.weight"] = (kv, H)
        out[p + "self_attn.v_proj.weight"] = (kv, H)
        if spec.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (q,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if spec.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "self_attn.o_proj.weight"] = (H, q)
        out[p + "post_attention_layernorm.weight"] = (H,)
        if layer in spec.moe_layers:
            out.update(moe_hf_shapes(spec, p))
            continue
        out[p + "mlp.gate_proj.weight"] = (I, H)
        out[p + "mlp.up_proj.weight"] = (I, H)
        out[p + "mlp.down_proj.weight"] = (H, I)
    out["model.norm.weight"] = (H,)
    if not spec.tie_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, H)
    return out


# --------------------------------------------------------------------------- walking a model chunk


def chunk_param_maps(chunk, spec: ModelSpec) -> list[ParamMap]:
    """Map every parameter of a GPTModel chunk to its HF tensors (ValueError on an unknown name)."""
    layers = list(chunk.decoder.layers)
    maps = []
    for name, _ in chunk.named_parameters():
        if name.rsplit(".", 1)[-1].startswith("lora_"):
            continue  # a LoRA adapter has no HF tensor of its own: it goes out merged into its base (weights.py)
        m = _LAYER_RE.match(name)
        if m:
            layer = layers[int(m.group(1))]
            prefix = _LAYER.format(l=layer.layer_number - 1)
            moe = moe_layer_rule(m.group(2), layer, prefix) if spec.is_moe else None
            if moe is not None:
                maps.append(ParamMap(name, moe[0], moe[1], moe[2]))
                continue
            rule = _LAYER_RULES.get(m.group(2))
            if rule is None:
                raise ValueError(f"no HF mapping for megatron parameter {name!r}")
            maps.append(ParamMap(name, rule[0], tuple(prefix + s for s in rule[1])))
        elif name == "embedding.word_embeddings.weight":
            maps.append(ParamMap(name, "vocab", ("model.embed_tokens.weight",)))
        elif name == "decoder.final_layernorm.weight":
            maps.append(ParamMap(name, "rep", ("model.norm.weight",)))
        elif name == "output_layer.weight":
            # With tied embeddings this is the last stage's copy of the embedding (PP > 1).
            source = "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"
            maps.append(ParamMap(name, "vocab", (source,)))
        else:
            raise ValueError(f"no HF mapping for megatron parameter {name!r}")
    return maps


@torch.no_grad()
def load_chunk_from_hf(chunk, spec: ModelSpec, get: Callable[[str], torch.Tensor], tp_rank: int, tp_size: int) -> int:
    """Copy this rank's shards into a chunk's parameters; ``get(hf_name)`` reads one HF tensor.
    Returns the number of parameters loaded."""
    params = dict(chunk.named_parameters())
    maps = chunk_param_maps(chunk, spec)
    for pm in maps:
        shard = shard_from_hf(pm.kind, [get(n) for n in pm.hf_names], spec, tp_rank, tp_size)
        p = params[pm.name]
        if tuple(shard.shape) != tuple(p.shape):
            raise ValueError(
                f"{pm.name}: HF {pm.hf_names} give a shard of {tuple(shard.shape)}, parameter is {tuple(p.shape)}"
            )
        p.copy_(shard)
    return len(maps)


def export_order(
    spec: ModelSpec, layer_owner: Callable[[int], int], ep_size: int = 1
) -> Iterator[tuple[tuple[str, ...], int, int]]:
    """(HF names of one megatron parameter, owning PP stage, owning EP rank or -1) in the fixed order
    every rank iterates.

    ``layer_owner(l)`` is the PP stage holding global layer l. The EP rank is that of the expert-
    parallel group (of the owning stage) holding a MoE expert; -1 for everything replicated over EP.
    The tied LM head is not exported (HF checkpoints of tied models do not store it).
    """
    last = layer_owner(spec.num_layers - 1)
    yield ("model.embed_tokens.weight",), 0, -1
    for layer in range(spec.num_layers):
        p = _LAYER.format(l=layer)
        owner = layer_owner(layer)
        moe = layer in spec.moe_layers
        for key, (_, hf_suffixes) in _export_layer_rules(spec):
            if moe and key.startswith("mlp."):
                continue
            yield tuple(p + s for s in hf_suffixes), owner, -1
        if moe:
            for _, names, ep_owner in moe_export_rules(spec, p, ep_size):
                yield names, owner, ep_owner
    yield ("model.norm.weight",), last, -1
    if not spec.tie_embeddings:
        yield ("lm_head.weight",), last, -1


def _export_layer_rules(spec: ModelSpec) -> list[tuple[str, tuple[str, tuple[str, ...]]]]:
    keys = [
        "input_layernorm.weight",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias",
        "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight",
        "self_attention.linear_proj.weight",
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
    ]
    if not spec.qkv_bias:
        keys.remove("self_attention.linear_qkv.bias")
    if not spec.qk_norm:
        keys.remove("self_attention.q_layernorm.weight")
        keys.remove("self_attention.k_layernorm.weight")
    return [(k, _LAYER_RULES[k]) for k in keys]
