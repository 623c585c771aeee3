"""A LoRA actor's adapters as a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
that ``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the Hugging Face base model.

Megatron fuses what HF keeps apart, and the adapters follow their base (actor/lora/adapters.py): ``linear_qkv`` holds
q, k and v interleaved per query group, ``linear_fc1`` gate and up. One adapter on a fused linear is the same
map as one adapter per HF projection that *shares A*: B's rows split exactly as the base weight's rows do
(hf/convert.py ``hf_from_shards``, applied to B as to a weight whose input width is r), and each projection
gets (A, its rows of B). So the PEFT adapter has the same rank and scaling and gives the same function:

    linear_qkv  (A, B)  ->  q_proj (A, B_q), k_proj (A, B_k), v_proj (A, B_v)
    linear_fc1  (A, B)  ->  gate_proj (A, B_gate), up_proj (A, B_up)
    linear_proj, linear_fc2  ->  o_proj, down_proj (A gathered over TP along its input, B as is)

An adapter that a PACS v2 reset merged into its base (actor/lora/reference.py) is no longer an adapter of the
HF base: such a checkpoint exports merged (``pacs-megatron export --merge``); ``tools/export.py`` says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from pacs_megatron.actor.lora.adapters import lora_modules
from pacs_megatron.actor.weights import tp_shards, unwrap
from pacs_megatron.hf.convert import chunk_param_maps, hf_from_shards
from pacs_megatron.hf.spec import ModelSpec
from pacs_megatron.parallel import ParallelGroups

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's HF name in adapter_model.safetensors."""


@torch.no_grad()
def peft_tensors(chunks: list, spec: ModelSpec, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """This rank's stages' adapters as PEFT-named full CPU tensors (collective over TP)."""
    out: dict[str, torch.Tensor] = {}
    for c in chunks:
        model = unwrap(c)
        maps = {pm.name: pm for pm in chunk_param_maps(model, spec)}
        for name, m in lora_modules(model).items():
            pm = maps[f"{name}.weight"]
            if m.lora_kind == "column":  # A whole on every rank, B split by output rows like the weight
                a_full = [m.lora_a.detach()] * len(pm.hf_names)
                b_full = hf_from_shards(pm.kind, tp_shards(m.lora_b, groups), spec)
            else:  # A split by input columns like the weight ("row"), B whole
                a_full = hf_from_shards("row", tp_shards(m.lora_a, groups), spec)
                b_full = [m.lora_b.detach()]
            for hf_name, a, b in zip(pm.hf_names, a_full, b_full):
                stem = PEFT_PREFIX + hf_name.removesuffix(".weight")
                out[f"{stem}.lora_A.weight"] = a.float().cpu().clone()  # q, k, v share A: one copy each
                out[f"{stem}.lora_B.weight"] = b.float().cpu().clone()
    return out


def gather_peft_tensors(chunks: list, spec: ModelSpec, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Every stage's adapters as PEFT-named full CPU tensors on every rank of the pipeline (collective over TP
    and PP): the adapter-only weight sync's payload (weight_sync/adapter.py). TP shards are gathered as the
    export gathers weights (:func:`peft_tensors`); the stages' sets, megabytes at most, are exchanged over the
    PP group in one object all-gather, where the weight export broadcasts tensor by tensor (its tensors are the
    whole model; these are ``r * (in + out)`` numbers a linear)."""
    local = peft_tensors(chunks, spec, groups)
    if groups.pp_size == 1:
        return local
    gathered: list = [None] * groups.pp_size
    dist.all_gather_object(gathered, local, group=groups.pp_group)
    return {k: v for part in gathered for k, v in part.items()}


def peft_config(tensors: dict[str, torch.Tensor], lora_cfg, base_dir: str) -> dict:
    """``adapter_config.json`` of PEFT-named ``tensors``: rank, alpha and dropout of ``actor.lora``, the HF
    projections that carry an adapter as its target modules, and the base directory as an absolute path (a
    relative one named a directory only from the run's working directory)."""
    targets = sorted({k.removeprefix(PEFT_PREFIX).split(".")[-3] for k in tensors})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(base_dir).resolve()),
        "r": lora_cfg.rank,
        "lora_alpha": lora_cfg.alpha,
        "lora_dropout": lora_cfg.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def save_peft_adapter(chunks: list, spec: ModelSpec, groups: ParallelGroups, lora_cfg, base_dir: str, out: str) -> None:
    """Write the PEFT adapter directory from global rank 0 (collective: every rank takes part)."""
    from safetensors.torch import save_file

    local = peft_tensors(chunks, spec, groups)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)  # the stages' adapters, megabytes at most
    if groups.rank == 0:
        tensors = {k: v for part in gathered for k, v in part.items()}
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = peft_config(tensors, lora_cfg, base_dir)
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    dist.barrier()
