"""Moving whole models between HF checkpoints and this rank's Megatron shards.

    load_hf_weights:   HF safetensors --(each rank reads what it holds)--> this rank's shards
    export_hf_weights: shards --TP all-gather--> full tensor on the owning stage --PP broadcast-->
                       (hf_name, tensor) on every rank, one tensor at a time, same order everywhere
                       (MoE experts: the EP rank holding one broadcasts it over the EP group instead
                       of the TP all-gather)
    save_hf:           export_hf_weights --rank 0--> config.json + safetensors (+ tokenizer files)

Every data-parallel replica and every CP rank holds the same weights, so each pipeline gathers on
its own (no DP or CP traffic). The layout maths lives in hf/convert.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pacs_megatron.actor.lora.adapters import adapters_off, lora_modules, merged_weight
from pacs_megatron.hf.convert import (
    chunk_param_maps,
    export_order,
    hf_from_shards,
    hf_shapes,
    load_chunk_from_hf,
    shard_from_hf,
)
from pacs_megatron.hf.io import SafetensorsReader, copy_tokenizer_files, write_safetensors
from pacs_megatron.hf.spec import ModelSpec
from pacs_megatron.parallel import ParallelGroups
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


def unwrap(model):
    """The GPTModel inside megatron's DDP (or any ``.module`` wrapper)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def load_hf_weights(chunks: list, spec: ModelSpec, model_dir: str | os.PathLike, groups: ParallelGroups) -> None:
    """Load this rank's shards of every chunk from the HF checkpoint in ``model_dir``."""
    reader = SafetensorsReader(model_dir)
    try:
        n = sum(load_chunk_from_hf(unwrap(c), spec, reader.get, groups.tp_rank, groups.tp_size) for c in chunks)
    finally:
        reader.close()
    logger.info("loaded %d HF tensors per rank from %s", n, model_dir)


def layer_owner(spec: ModelSpec, groups: ParallelGroups):
    """Global layer -> owning PP stage, as megatron places layers (interleaved when vpp > 1)."""
    per_virtual = spec.num_layers // (groups.pp_size * groups.vpp_size)
    return lambda layer: (layer // per_virtual) % groups.pp_size


def _local_params(chunks: list, spec: ModelSpec) -> dict[tuple[str, ...], tuple[str, torch.Tensor, Any]]:
    """HF names -> (kind, local shard, its LoRA linear or None) for every parameter this rank holds (tied
    LM-head copy excluded). A LoRA linear's weight goes out merged, W + (alpha / r) B A (the policy, not its
    frozen base), merged when it is exported: one merged copy at a time, as the export holds one tensor."""
    out = {}
    for c in chunks:
        model = unwrap(c)
        params = dict(model.named_parameters())
        lora = {f"{n}.weight": m for n, m in lora_modules(model).items()}
        for pm in chunk_param_maps(model, spec):
            if pm.name == "output_layer.weight" and spec.tie_embeddings:
                continue
            out[pm.hf_names] = (pm.kind, params[pm.name], lora.get(pm.name))
    return out


@torch.no_grad()
def export_hf_weights(
    chunks: list, spec: ModelSpec, groups: ParallelGroups, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` on every rank of the pipeline, in HF order (collective).

    Tensors are on ``groups.device``, in ``dtype`` (default: the parameters' dtype). Only one
    parameter's full tensors exist at a time. They may be views of (or the) live parameters, possibly
    non-contiguous: consume them before the next optimizer step, and copy for storage.
    """
    local = _local_params(chunks, spec)
    shapes = hf_shapes(spec)
    owner_of = layer_owner(spec, groups)
    param_dtype = next(iter(local.values()))[1].dtype
    out_dtype = dtype or param_dtype
    for hf_names, owner, ep_owner in export_order(spec, owner_of, groups.ep_size):
        if groups.pp_rank == owner and ep_owner >= 0:  # a MoE expert: whole on one EP rank of this stage
            tensors = _expert_tensors(local, hf_names, ep_owner, shapes, spec, groups, out_dtype)
        elif groups.pp_rank == owner:
            if hf_names not in local:
                raise RuntimeError(f"stage {owner} should hold {hf_names} but has no such parameter")
            kind, shard, lora = local[hf_names]
            # adapters off (adapters_off): the base alone, which the adapter-only sync sends (weight_sync/adapter.py)
            shard = merged_weight(lora) if lora is not None and lora.lora_enabled else shard
            tensors = [t.to(out_dtype) for t in hf_from_shards(kind, tp_shards(shard, groups), spec)]
            if groups.pp_size > 1:  # collectives need contiguous buffers; a local consumer does not
                tensors = [t.contiguous() for t in tensors]
        else:
            tensors = [torch.empty(shapes[n], dtype=out_dtype, device=groups.device) for n in hf_names]
        if groups.pp_size > 1:
            _broadcast_from(tensors, groups.pp_group, owner)
        yield from zip(hf_names, tensors)


def tp_shards(shard: torch.Tensor, groups: ParallelGroups) -> list[torch.Tensor]:
    """Every TP rank's shard of a tensor in TP-rank order (the shard itself, detached, at TP = 1)."""
    shard = shard.detach()
    if groups.tp_size == 1:
        return [shard]
    shards = [torch.empty_like(shard) for _ in range(groups.tp_size)]
    dist.all_gather(shards, shard.contiguous(), group=groups.tp_group)
    return shards


def _expert_tensors(local, hf_names, ep_owner, shapes, spec, groups, out_dtype) -> list[torch.Tensor]:
    """One expert's HF tensors on every rank of the EP group: its holder broadcasts them."""
    if groups.ep_rank == ep_owner:
        kind, shard, _ = local[hf_names]  # experts carry no adapter (actor/lora/adapters.py)
        tensors = [t.to(out_dtype).contiguous() for t in hf_from_shards(kind, [shard.detach()], spec)]
    else:
        tensors = [torch.empty(shapes[n], dtype=out_dtype, device=groups.device) for n in hf_names]
    if groups.ep_size > 1:
        _broadcast_from(tensors, groups.ep_group, ep_owner)
    return tensors


def _broadcast_from(tensors: list[torch.Tensor], group, owner: int) -> None:
    """Every rank of ``group`` gets the tensors of its rank ``owner`` (a group-local rank), in place."""
    src = dist.get_global_rank(group, owner)
    for t in tensors:
        dist.broadcast(t, src=src, group=group)


def save_hf(
    chunks: list,
    spec: ModelSpec,
    groups: ParallelGroups,
    hf_config,
    path: str | os.PathLike,
    model_dir: str | os.PathLike | None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write a HF checkpoint (config.json, safetensors, tokenizer files) from rank 0 (collective). Only CP rank 0
    of each replica exports: rank 0's TP and PP groups hold no rank of another CP rank (MoE, whose EP groups
    could, is refused at cp > 1), so the CP ranks > 0 skip the gathers together and wait at the barrier."""
    items = export_hf_weights(chunks, spec, groups, dtype)
    if groups.rank != 0:
        if groups.cp_rank == 0:
            for _ in items:  # take part in the gathers and broadcasts
                pass
        dist.barrier()
        return
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    files = write_safetensors(((n, t.to("cpu", copy=True)) for n, t in items), out)  # own storage per tensor
    written_dtype = dtype or next(p for c in chunks for p in c.parameters()).dtype
    hf_config.dtype = written_dtype  # transformers >= 4.56 name; older versions read torch_dtype
    hf_config.save_pretrained(out)
    if model_dir is not None:
        copy_tokenizer_files(model_dir, out)
    logger.info("saved HF checkpoint to %s (%s)", out, ", ".join(files))
    dist.barrier()


@contextmanager
def swapped_hf_weights(chunks: list, spec: ModelSpec, groups: ParallelGroups, tensors: dict[str, torch.Tensor]):
    """Temporarily hold other full HF-named tensors (e.g. the FP8 quantize-dequantized weights the engine
    got): every parameter with an HF tensor in ``tensors`` is overwritten with this rank's shard (all
    of its HF tensors must be given: q/k/v together), and restored bit for bit on exit. Local, no
    collective: every rank holds every tensor it needs. Costs one copy of the swapped parameters."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    # the given tensors are whole weights (a LoRA actor's merged ones): no adapter on top of them
    with adapters_off([unwrap(c) for c in chunks]):
        try:
            with torch.no_grad():
                for c in chunks:
                    model = unwrap(c)
                    params = dict(model.named_parameters())
                    for pm in chunk_param_maps(model, spec):
                        if not any(n in tensors for n in pm.hf_names):
                            continue
                        missing = [n for n in pm.hf_names if n not in tensors]
                        if missing:
                            raise KeyError(f"swapped_hf_weights: {pm.name} needs {missing} as well")
                        p = params[pm.name]
                        hf = [tensors[n].to(p.device, p.dtype) for n in pm.hf_names]
                        shard = shard_from_hf(pm.kind, hf, spec, groups.tp_rank, groups.tp_size)
                        saved.append((p, p.detach().clone()))
                        p.copy_(shard)
            yield
        finally:
            with torch.no_grad():
                for p, original in saved:
                    p.copy_(original)
