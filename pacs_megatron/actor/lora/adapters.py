"""LoRA adapters on megatron-core's tensor-parallel linears (``actor.lora``, issue 43; docs/lora.md).

    y = W x + (alpha / r) * B A dropout(x)        W frozen; A [r, in] (Kaiming-uniform), B [out, r] = 0 (PEFT's init)

Each adapter is sharded the way its base is (column-parallel: B split like W, A replicated; row-parallel: A
split, B replicated), so a rank's merged weight is a local product, and no collective is added in forward or
per micro-batch: :func:`allreduce_replicated_grads` sums the replicated factor's gradient once a step.
The adapter is attached in place (:func:`attach_lora`), so every base parameter keeps its name for
checkpoints, the HF name maps and the weight sync. Sequence parallelism is refused (:func:`apply_lora`).
Sharding table, collectives, Megatron-Bridge's layout: docs/lora.md, "Sharding" and "Collectives".
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron's names of the attention and MLP linears an adapter may wrap (``actor.lora.targets``)."""

REPLICATED = "lora_tp_replicated"
"""Attribute set on an adapter factor that every TP rank holds whole: its gradient is partial per rank."""


def _column_forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
    """ColumnParallelLinear.forward with the adapter: the input-gradient all-reduce in front of both. The frozen
    base multiplies through ``F.linear``, not megatron's autograd function, which computes a weight gradient
    whether the weight wants one or not (a third of the layer's backward, thrown away)."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    if self.tp_group is not None and self.tp_group.size() > 1:
        x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
    out = F.linear(x, self.weight if weight is None else weight, None if self.skip_bias_add else self.bias)
    if self.lora_enabled:
        out = out + _delta(self, x).to(out.dtype)
    return out, (self.bias if self.skip_bias_add else None)


def _row_forward(self, x: torch.Tensor):
    """RowParallelLinear.forward (input_is_parallel, no SP) with the adapter's partial product added before
    its all-reduce; the frozen base through ``F.linear`` (see _column_forward)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    out = F.linear(x, self.weight)
    if self.lora_enabled:
        out = out + _delta(self, x).to(out.dtype)
    if self.tp_group is not None and self.tp_group.size() > 1:
        out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
    if self.skip_bias_add:
        return out, self.bias
    return (out + self.bias if self.bias is not None else out), None


def _delta(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    a, b = module.lora_a, module.lora_b
    return (module.lora_dropout(x).to(a.dtype) @ a.t()) @ b.t() * module.lora_scaling


def _sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    """The base layer's checkpoint entries plus the adapter's, each sharded on its TP axis (a replicated
    factor is saved once, like a bias of a row-parallel layer). A gated MLP's ``linear_fc1`` holds its gate
    and up rows per TP rank as ``[gate_r; up_r]``, which megatron's MLP saves through its SwiGLU factory (two
    shards a rank, so the global tensor is ``[gate; up]`` at any TP); its B gets the same factory, or a
    checkpoint loaded at another TP would pair B's rows with the wrong weight rows."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0, "lora_b": 0} if self.lora_kind == "column" else {"weight": 1, "lora_a": 1}
    sd = make_sharded_tensors_for_checkpoint(
        self.state_dict(prefix="", keep_vars=True),
        prefix,
        axes,
        sharded_offsets,
        tp_group=self.tp_group,
        dp_cp_group=(metadata or {}).get("dp_cp_group"),
    )
    if getattr(self, "lora_target", "") == "linear_fc1" and getattr(self.config, "gated_linear_unit", False):
        singleton = (metadata or {}).get("singleton_local_shards", False)
        sd[f"{prefix}lora_b"] = apply_swiglu_sharded_factory(sd[f"{prefix}lora_b"], sharded_offsets, singleton)
    return sd


def attach_lora(module: nn.Module, kind: str, rank: int, alpha: float, dropout: float = 0.0) -> nn.Module:
    """Give one megatron ``ColumnParallelLinear`` (``kind="column"``, no ``gather_output``) or
    ``RowParallelLinear`` (``kind="row"``, ``input_is_parallel``) an adapter, in place: parameters ``lora_a``
    and ``lora_b`` on the module (so every existing parameter keeps its name: checkpoints, the HF name maps
    and the weight sync see the base where it was), its forward and checkpoint entries replaced."""
    if getattr(module, "sequence_parallel", False) or getattr(module, "explicit_expert_comm", False):
        raise ValueError("LoRA: sequence parallelism and expert linears are not supported yet")
    if kind == "column":
        if getattr(module, "gather_output", False):
            raise ValueError("LoRA: a column-parallel base must not gather its output")
        a_shape, b_shape, replicated = (rank, module.input_size), (module.output_size_per_partition, rank), "lora_a"
        # The base's own input-gradient all-reduce moves in front of base and adapter (module docstring).
        module.allreduce_dgrad = False
        module.disable_grad_reduce = True
        forward: Callable[..., Any] = _column_forward
    elif kind == "row":
        if not getattr(module, "input_is_parallel", False):
            raise ValueError("LoRA: a row-parallel base must take a parallel input")
        a_shape, b_shape, replicated = (rank, module.input_size_per_partition), (module.output_size, rank), "lora_b"
        forward = _row_forward
    else:
        raise ValueError(f"LoRA: kind {kind!r} is neither column nor row")
    for p in module.parameters():
        p.requires_grad_(False)  # the base is frozen: only the adapters reach the optimizer
    module.gradient_accumulation_fusion = False  # no main_grad for the frozen weight to accumulate into
    dev, dtype = module.weight.device, module.weight.dtype
    # B = 0 (PEFT's init: step 0 is the base); A is drawn by init_lora_a from its own seed, never from the
    # global RNG, so adding LoRA leaves the run's sampling streams as they were
    module.lora_a = nn.Parameter(torch.zeros(a_shape, device=dev, dtype=dtype))
    module.lora_b = nn.Parameter(torch.zeros(b_shape, device=dev, dtype=dtype))
    setattr(getattr(module, replicated), REPLICATED, True)
    # megatron counts a parameter without these attributes once per TP group (a duplicate on every rank): the
    # sharded factor must carry them, or the gradient norm (and its clipping) misses the other ranks' shards
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    sharded, axis = ("lora_b", 0) if kind == "column" else ("lora_a", 1)
    set_tensor_model_parallel_attributes(getattr(module, sharded), is_parallel=True, dim=axis, stride=1)
    module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    module.lora_kind, module.lora_rank, module.lora_scaling = kind, rank, alpha / rank
    module.lora_enabled = True  # off: the base alone (the reference policy without a copy of the model)
    # the adapters merged into the base so far, (A, B, scaling) on the host: an adapter-only checkpoint
    # replays them onto the pretrained base (actor/checkpoint.py); None once a checkpoint holds the base whole
    module.lora_merges = []
    module.forward = types.MethodType(forward, module)
    module.sharded_state_dict = types.MethodType(_sharded_state_dict, module)
    return module


def _merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling B A`` in fp32, cast to W's dtype: the one formula of every merge (weight sync, export,
    a v2 reset and its replay on load), so that a replay on the same layout gives the same bits."""
    delta = (b.detach().float() @ a.detach().float()) * scaling
    return (weight.detach().float() + delta).to(weight.dtype)


def merged_weight(module: nn.Module) -> torch.Tensor:
    """This rank's shard of ``W + (alpha / r) B A`` in the base weight's shape and dtype (no collective)."""
    return _merged(module.weight, module.lora_a, module.lora_b, module.lora_scaling)


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module, for every linear of ``model`` that carries an adapter."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_kind")}


def _layer_numbers(model: nn.Module) -> dict[str, int]:
    """Qualified module name -> megatron's global layer number, for every module inside a transformer layer
    (the same on every PP / VPP layout: adapters are seeded by it)."""
    out: dict[str, int] = {}
    for name, layer in model.named_modules():
        number = getattr(layer, "layer_number", None)
        if isinstance(number, int) and not hasattr(layer, "lora_kind"):
            for sub, _ in layer.named_modules():
                out.setdefault(f"{name}.{sub}" if sub else name, number)
    return out


def init_lora_a(module: nn.Module, seed: int, tp_rank: int, tp_size: int) -> None:
    """PEFT's init of A (Kaiming-uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))) drawn whole from
    ``seed`` and cut to this rank's shard, so every layout starts from the same full A; B = 0."""
    r, cols = module.lora_a.shape
    full_in = cols * tp_size if module.lora_kind == "row" else cols
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(full_in)
    full = (torch.rand(r, full_in, generator=gen, dtype=torch.float64) * 2 - 1) * bound
    if module.lora_kind == "row":
        full = full[:, tp_rank * cols : (tp_rank + 1) * cols]
    with torch.no_grad():
        module.lora_a.copy_(full)
        module.lora_b.zero_()


def apply_lora(
    module: nn.Module,
    targets: Iterable[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    *,
    seed: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> list[nn.Module]:
    """Attach an adapter to every linear of ``module`` whose name is in ``targets`` (megatron's names:
    :data:`LORA_TARGETS`; MoE experts' linears are skipped) and freeze every other parameter; returns the
    adapted linears. A is seeded by (``seed``, global layer number, target), so it is the same at every
    TP / PP / DP layout. An unknown name, or one that matches nothing, raises ValueError naming the linears
    the model has; so does a rank larger than a shard."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    targets = list(targets)
    if rank < 1:
        raise ValueError(f"actor.lora.rank={rank} must be >= 1")
    linears = {
        n: m
        for n, m in module.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and ".experts." not in f".{n}."
    }
    found = sorted({n.rsplit(".", 1)[-1] for n in linears})
    missing = [t for t in targets if t not in found]
    if missing:
        raise ValueError(f"actor.lora.targets: {missing} not in this model; its linears are {found}")
    for p in module.parameters():
        p.requires_grad_(False)
    layers = _layer_numbers(module)
    adapted = []
    for name, m in linears.items():
        target = name.rsplit(".", 1)[-1]
        if target not in targets:
            continue
        limit = min(m.weight.shape)
        if rank > limit:
            raise ValueError(f"actor.lora.rank={rank} exceeds {name}'s shard {tuple(m.weight.shape)}: at most {limit}")
        attach_lora(m, "column" if isinstance(m, ColumnParallelLinear) else "row", rank, alpha, dropout)
        m.lora_target = target  # linear_fc1's B is saved as its weight is (_sharded_state_dict)
        m.lora_seed = seed * 1_000_003 + layers.get(name, 0) * 16 + LORA_TARGETS.index(target)
        init_lora_a(m, m.lora_seed, tp_rank, tp_size)
        adapted.append(m)
    return adapted


@torch.no_grad()
def merge_and_restart(model: nn.Module, restart: int, tp_rank: int, tp_size: int) -> None:
    """Fold every adapter into its base (W <- W + (alpha / r) B A, this rank's shard) and start it again
    from PEFT's init (A redrawn from its seed and ``restart``, B = 0): the model computes the same function
    and the base is now the live policy (LoRA's PACS v2 reset; docs/lora.md). The merged adapters are kept
    on the host (``lora_merges``) for an adapter-only checkpoint to replay (:func:`replay_merges`)."""
    for m in lora_modules(model).values():
        if m.lora_merges is not None:
            merged = (m.lora_a.detach().to("cpu", copy=True), m.lora_b.detach().to("cpu", copy=True), m.lora_scaling)
            m.lora_merges.append(merged)
        m.weight.copy_(merged_weight(m))
        init_lora_a(m, m.lora_seed + 7919 * restart, tp_rank, tp_size)


@torch.no_grad()
def replay_merges(module: nn.Module, merges: list[tuple[torch.Tensor, torch.Tensor, float]]) -> None:
    """Fold ``merges`` ((A, B, scaling) of this rank's shards, oldest first) into the base, as
    :func:`merge_and_restart` did: the same formula in the same order, so on the same layout the base comes
    back bit for bit (a different TP layout multiplies other shard shapes: equal up to fp32 rounding). They
    are appended to the module's ``lora_merges`` (on the host)."""
    dev = module.weight.device
    kept = module.lora_merges if module.lora_merges is not None else []
    for a, b, scaling in merges:
        module.weight.copy_(_merged(module.weight, a.to(dev), b.to(dev), scaling))
        kept.append((a.to("cpu"), b.to("cpu"), scaling))
    module.lora_merges = kept


@contextmanager
def adapters_off(models: Iterable[nn.Module]) -> Iterator[None]:
    """Every adapter of ``models`` off inside the block (the base model: LoRA's reference policy, no second
    copy), and as it was after."""
    adapted = [m for model in models for m in lora_modules(model).values()]
    was = [m.lora_enabled for m in adapted]
    for m in adapted:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, on in zip(adapted, was):
            m.lora_enabled = on


def replicated_params(module: nn.Module) -> list[nn.Parameter]:
    """The adapter factors every TP rank holds whole (their gradients are partial per rank)."""
    return [p for p in module.parameters() if getattr(p, REPLICATED, False)]


def allreduce_replicated_grads(modules: nn.Module | Iterable[nn.Module], tp_group, attr: str = "grad") -> None:
    """Sum the replicated factors' partial gradients of ``modules`` (a model, or its VPP chunks) over
    ``tp_group``, all in one coalesced all-reduce; ``attr`` names where the gradient lives (``grad``, or
    ``main_grad`` under megatron's DDP)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    params = [p for m in ([modules] if isinstance(modules, nn.Module) else modules) for p in replicated_params(m)]
    grads = [getattr(p, attr) for p in params if getattr(p, attr, None) is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sum_replicated_lora_grads(config, tp_group) -> None:
    """Make megatron's grad finalisation (``config.finalize_model_grads_func``, called by every schedule after
    the last backward) first sum the replicated adapter factors' partial gradients over the TP group: one
    coalesced all-reduce per optimizer step, before the data-parallel reduction."""
    finalize = config.finalize_model_grads_func

    def finalize_with_lora(model, *args, **kwargs):
        allreduce_replicated_grads(model, tp_group, attr="main_grad")  # every chunk's in one call
        return finalize(model, *args, **kwargs)

    config.finalize_model_grads_func = finalize_with_lora
