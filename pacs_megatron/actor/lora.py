"""LoRA adapters on megatron-core's tensor-parallel linears (issue 43, first part: the layer and its maths).

    y = W x + (alpha / r) * B A dropout(x)        W frozen; A [r, in] (Kaiming-uniform), B [out, r] = 0 (PEFT's init)

Each adapter is sharded the way its base is, so that a TP rank holds exactly the slice of ``B A`` that
matches its slice of ``W`` (the merged weight is a local product: no collective for a weight sync or export):

    base              its W shard          A                    B                    merged shard
    column-parallel   [out / tp, in]       [r, in] replicated   [out / tp, r]        B_shard @ A
    (linear_qkv, linear_fc1)
    row-parallel      [out, in / tp]       [r, in / tp]         [out, r] replicated  B @ A_shard
    (linear_proj, linear_fc2)

Collectives: none in forward and none per micro-batch beyond what the base layer already does.
- Column: the base all-reduces the gradient of its input (megatron does it inside the matmul's backward,
  overlapped with the weight gradient). With the base frozen there is no weight gradient to overlap, so
  :class:`LoRAColumn` moves that one all-reduce in front of base and adapter together
  (``copy_to_tensor_model_parallel_region``): the partial input gradients of both are summed by it.
- Row: the adapter's partial product ``x_shard A_shard^T B^T`` is added to the base's partial output
  *before* the base's all-reduce, which sums both.
- The replicated factor (A of a column layer, B of a row layer) gets a partial gradient on each TP rank
  (its output gradient is split over the ranks). :func:`allreduce_replicated_grads` sums them over the TP
  group once per optimizer step, all adapters in one coalesced call (as megatron sums the layer-norm
  gradients under sequence parallelism): r * (in + out) numbers a layer, against Megatron-Bridge's
  layout, whose column adapter (``ParallelLinearAdapter``: A column-parallel with ``gather_output``)
  all-gathers a ``[tokens, r]`` activation in every forward and splits its gradient in every backward.

Sequence parallelism is not supported yet (the column adapter would need the gathered sequence; SP needs
Transformer Engine or Apex, which this machine has not): :func:`apply_lora` refuses it in one line.
Not yet wired: ``actor.lora`` in the config, the optimizer over adapters only, checkpoints, the merged and
adapter-only syncs and the PEFT export (docs/lora.md says what is done and what is next).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron's names of the attention and MLP linears an adapter may wrap (``actor.lora.targets``)."""

REPLICATED = "lora_tp_replicated"
"""Attribute set on an adapter factor that every TP rank holds whole: its gradient is partial per rank."""


class _LoRA(nn.Module):
    """The adapter's factors and scaling; the subclasses place them around the base."""

    def __init__(
        self,
        base: nn.Module,
        a_shape: tuple[int, int],
        b_shape: tuple[int, int],
        rank: int,
        alpha: float,
        dropout: float,
        replicated: str,
    ) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)  # the base is frozen: only the adapters reach the optimizer
        dev, dtype = base.weight.device, base.weight.dtype
        self.lora_a = nn.Parameter(torch.empty(a_shape, device=dev, dtype=dtype))
        self.lora_b = nn.Parameter(torch.zeros(b_shape, device=dev, dtype=dtype))
        # PEFT's init: A Kaiming-uniform (a = sqrt(5), torch's nn.Linear default), B = 0: step 0 is the base
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        setattr(getattr(self, replicated), REPLICATED, True)
        self.rank, self.scaling = rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True  # off: the base alone (the reference policy without a copy of the model)

    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of ``W + (alpha / r) B A``, the shape of the base's weight (no collective)."""
        delta = (self.lora_b.float() @ self.lora_a.float()) * self.scaling
        return (self.base.weight.float() + delta).to(self.base.weight.dtype)

    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        return (self.dropout(x) @ self.lora_a.t()) @ self.lora_b.t() * self.scaling


class LoRAColumn(_LoRA):
    """LoRA around a ``ColumnParallelLinear`` without ``gather_output`` (qkv, fc1): A replicated, B sharded."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0) -> None:
        if getattr(base, "gather_output", False) or getattr(base, "sequence_parallel", False):
            raise ValueError("LoRAColumn: the base must not gather its output nor use sequence parallelism")
        super().__init__(
            base, (rank, base.input_size), (base.output_size_per_partition, rank), rank, alpha, dropout, "lora_a"
        )
        # The base's own input-gradient all-reduce moves in front of base and adapter (module docstring).
        base.allreduce_dgrad = False
        base.disable_grad_reduce = True

    def forward(self, x: torch.Tensor, *args, **kwargs):
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        if self.base.tp_group is not None and self.base.tp_group.size() > 1:
            x = copy_to_tensor_model_parallel_region(x, group=self.base.tp_group)
        out, bias = self.base(x, *args, **kwargs)
        if self.enabled:
            out = out + self._delta(x).to(out.dtype)
        return out, bias


class LoRARow(_LoRA):
    """LoRA around a ``RowParallelLinear`` with ``input_is_parallel`` (proj, fc2): A sharded, B replicated."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0) -> None:
        if not getattr(base, "input_is_parallel", False) or getattr(base, "sequence_parallel", False):
            raise ValueError("LoRARow: the base must take a parallel input and not use sequence parallelism")
        super().__init__(
            base, (rank, base.input_size_per_partition), (base.output_size, rank), rank, alpha, dropout, "lora_b"
        )

    def forward(self, x: torch.Tensor):
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        base = self.base
        # RowParallelLinear.forward with the adapter's partial product added before its all-reduce
        out = base._forward_impl(
            input=x,
            weight=base.weight,
            bias=None,
            gradient_accumulation_fusion=False,  # the base weight has no gradient
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=None,
            grad_output_buffer=None,
        )
        if self.enabled:
            out = out + self._delta(x).to(out.dtype)
        if base.tp_group is not None and base.tp_group.size() > 1:
            out = reduce_from_tensor_model_parallel_region(out, group=base.tp_group)
        if base.skip_bias_add:
            return out, base.bias
        return (out + base.bias if base.bias is not None else out), None


def apply_lora(module: nn.Module, targets: Iterable[str], rank: int, alpha: float, dropout: float = 0.0) -> list[_LoRA]:
    """Wrap every child named in ``targets`` (megatron's names: :data:`LORA_TARGETS`) in its adapter, freeze
    every other parameter of ``module``; returns the adapters. An unknown name, or one that matches nothing,
    raises ValueError naming the linears the model has."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    targets = list(targets)
    if rank < 1:
        raise ValueError(f"actor.lora.rank={rank} must be >= 1")
    found = sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, m in module.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
        }
    )
    missing = [t for t in targets if t not in found]
    if missing:
        raise ValueError(f"actor.lora.targets: {missing} not in this model; its linears are {found}")
    for p in module.parameters():
        p.requires_grad_(False)
    adapters: list[_LoRA] = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name not in targets or isinstance(parent, _LoRA):
                continue
            kind = LoRAColumn if isinstance(child, ColumnParallelLinear) else LoRARow
            limit = min(child.weight.shape)
            if rank > limit:
                raise ValueError(
                    f"actor.lora.rank={rank} exceeds {name}'s shard ({tuple(child.weight.shape)}): at most {limit}"
                )
            adapter = kind(child, rank, alpha, dropout)
            setattr(parent, name, adapter)
            adapters.append(adapter)
    return adapters


def set_lora_enabled(adapters: Iterable[_LoRA], enabled: bool) -> None:
    """Adapters on (the policy) or off (the base model: LoRA's reference policy, no second copy)."""
    for a in adapters:
        a.enabled = enabled


def replicated_params(module: nn.Module) -> list[nn.Parameter]:
    """The adapter factors every TP rank holds whole (their gradients are partial per rank)."""
    return [p for p in module.parameters() if getattr(p, REPLICATED, False)]


def allreduce_replicated_grads(module: nn.Module, tp_group, attr: str = "grad") -> None:
    """Sum the replicated factors' partial gradients over ``tp_group``, all in one coalesced all-reduce;
    ``attr`` names where the gradient lives (``grad``, or ``main_grad`` under megatron's DDP)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    grads = [getattr(p, attr) for p in replicated_params(module) if getattr(p, attr, None) is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
