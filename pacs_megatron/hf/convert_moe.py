"""Qwen3-MoE expert layers: Hugging Face <-> Megatron names and layouts (the dense rules are in convert.py).

Megatron (local spec, non-grouped ``SequentialMLP``) holds, per MoE layer on this rank:

    mlp.router.weight                                   [E, H]        <- mlp.gate.weight (replicated)
    mlp.experts.local_experts.{j}.linear_fc1.weight     [2*Ie, H]     <- experts.{g}.gate_proj ; up_proj
    mlp.experts.local_experts.{j}.linear_fc2.weight     [H, Ie]       <- experts.{g}.down_proj

with ``g = ep_rank * E/ep + j`` (megatron's ``local_expert_indices``). Experts are never tensor-
parallel here (``expert_tensor_parallel_size=1``): EP splits the expert list and every expert
tensor is whole, so the TP rank plays no part and the kinds below ignore it:

    "expert_fc1"  [gate; up] stacked on rows (megatron chunks fc1's output: act(first) * second)
    "expert"      copied as is

On export, the rank of the expert-parallel group that holds expert g broadcasts it to the others
(actor/weights.py), so every rank sees every HF tensor, in the same order.
"""

from __future__ import annotations

import re

import torch

from pacs_megatron.hf.spec import ModelSpec

EXPERT_KINDS = ("expert_fc1", "expert")
ROUTER_RULE = ("rep", ("mlp.gate.weight",))
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def expert_hf_names(prefix: str, g: int, which: str) -> tuple[str, ...]:
    """HF tensors of global expert ``g``'s fc1 (gate, up) or fc2 (down) inside layer ``prefix``."""
    e = f"{prefix}mlp.experts.{g}."
    return (e + "gate_proj.weight", e + "up_proj.weight") if which == "linear_fc1" else (e + "down_proj.weight",)


def moe_layer_rule(suffix: str, layer_module, prefix: str) -> tuple[str, tuple[str, ...], int] | None:
    """(kind, HF names, global expert index or -1) of a MoE parameter suffix, or None when not one.

    ``layer_module`` is the megatron TransformerLayer (its MoELayer knows its ``local_expert_indices``).
    """
    if suffix == "mlp.router.weight":
        return ROUTER_RULE[0], tuple(prefix + s for s in ROUTER_RULE[1]), -1
    m = _LOCAL_EXPERT.match(suffix)
    if m is None:
        return None
    g = layer_module.mlp.local_expert_indices[int(m.group(1))]
    kind = "expert_fc1" if m.group(2) == "linear_fc1" else "expert"
    return kind, expert_hf_names(prefix, g, m.group(2)), g


def expert_shard_from_hf(kind: str, hf: list[torch.Tensor]) -> torch.Tensor:
    """Megatron tensor of one local expert from its HF tensors (no TP split)."""
    return torch.cat(hf, dim=0) if kind == "expert_fc1" else hf[0]


def expert_hf_from_shard(kind: str, shard: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of :func:`expert_shard_from_hf` (views of ``shard``)."""
    return list(shard.chunk(2, dim=0)) if kind == "expert_fc1" else [shard]


def moe_hf_shapes(spec: ModelSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    """HF shapes of one MoE layer's router and experts, in export order."""
    H, Ie = spec.hidden_size, spec.moe_ffn_hidden_size  # noqa: N806
    out: dict[str, tuple[int, ...]] = {prefix + "mlp.gate.weight": (spec.num_experts, H)}
    for g in range(spec.num_experts):
        e = f"{prefix}mlp.experts.{g}."
        out[e + "gate_proj.weight"] = (Ie, H)
        out[e + "up_proj.weight"] = (Ie, H)
        out[e + "down_proj.weight"] = (H, Ie)
    return out


def moe_export_rules(spec: ModelSpec, prefix: str, ep_size: int):
    """(kind, HF names, owning EP rank or -1 for replicated) of one MoE layer's tensors, in order."""
    per_rank = spec.num_experts // ep_size
    yield ROUTER_RULE[0], tuple(prefix + s for s in ROUTER_RULE[1]), -1
    for g in range(spec.num_experts):
        for which, kind in (("linear_fc1", "expert_fc1"), ("linear_fc2", "expert")):
            yield kind, expert_hf_names(prefix, g, which), g // per_rank
