"""Stochastic rounding of the bf16 parameters the forward reads from the fp32 main weights (issue 58).

Round-to-nearest moves a bf16 parameter only once its main weight has moved half a bf16 spacing, which at
lr 1e-5 takes SmolLM2's weights 20-40 steps. Rounding up with probability equal to the remainder's share of
the spacing makes the bf16 copy an unbiased estimate of the fp32 main weight at every step, with noise of at
most one spacing. The random bits come from a pool of :data:`POOL` values drawn per step and read at random
offsets (each weight's noise is still uniform over the 16 dropped bits). The generator is seeded by
``(seed, Adam's step)`` and consumed in parameter order, so replicas of a parameter round identically and a
resumed run rounds as an uninterrupted one (after a PACS v2 reset the sequence restarts, still unbiased).
Measurements and cost: docs/benchmarks.md, "bf16 parameters: stochastic rounding vs round-to-nearest".
"""

from __future__ import annotations

import torch

POOL = 1 << 20
"""Random 16-bit values drawn per step (a chunk of a tensor is at most this long)."""
_LOW16 = 0xFFFF
_HIGH16 = -65536  # int32 mask keeping the sign, exponent and the 7 mantissa bits bf16 keeps


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, gen: torch.Generator, pool: torch.Tensor) -> None:
    """``dst`` (bf16) <- ``src`` (fp32) rounded stochastically: adding uniform noise to the 16 bits bf16 drops,
    then truncating, rounds up with probability remainder / spacing. Non-finite values are copied as they are
    (the noise could carry a NaN's payload into the exponent; inf stays inf). Other dtypes: a plain copy."""
    if dst.dtype != torch.bfloat16 or src.dtype != torch.float32:
        dst.copy_(src)
        return
    bits = src.detach().reshape(-1).view(torch.int32)
    out = dst.view(-1) if dst.is_contiguous() else None
    flat = out if out is not None else torch.empty(dst.numel(), dtype=torch.bfloat16, device=dst.device)
    offsets = torch.randint(0, POOL, (max(1, -(-bits.numel() // POOL)),), generator=gen, device="cpu").tolist()
    for k, start in enumerate(range(0, bits.numel(), POOL)):
        chunk = bits[start : start + POOL]
        rounded = (chunk + pool[offsets[k] : offsets[k] + chunk.numel()]).bitwise_and_(_HIGH16)
        flat[start : start + chunk.numel()].copy_(rounded.view(torch.float32))
    bad = ~torch.isfinite(src)
    if bool(bad.any()):
        flat.view(src.shape)[bad] = src[bad].to(torch.bfloat16)
    if out is None:
        dst.copy_(flat.view(dst.shape))


class StochasticRounder:
    """Draws one step's noise pool and rounds a list of (model bf16, main fp32) tensor pairs with it."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        """Base seed (``model.seed``): the same on every rank, so replicas round alike."""

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], step: int) -> None:
        """Round every ``(dst, src)`` pair of this step, in order (deterministic given seed, step and order)."""
        if not pairs:
            return
        device = pairs[0][0].device
        gen = torch.Generator(device="cpu").manual_seed((self.seed * 1_000_003 + step) % (1 << 63))
        pool = torch.randint(0, _LOW16 + 1, (2 * POOL,), dtype=torch.int32, generator=gen).to(device)
        for dst, src in pairs:
            stochastic_round_(dst, src, gen, pool)


def _adam_step(inner) -> int:
    """Adam's step count (the same for every parameter; 0 before the first step)."""
    for state in inner.state.values():
        step = state.get("step")
        if step is not None:
            return int(step.item() if torch.is_tensor(step) else step)
    for group in inner.param_groups:  # Apex / TE's FusedAdam keep it per group
        if "step" in group:
            return int(group["step"])
    return 0


def use_stochastic_rounding(optimizer, seed: int) -> int:
    """Make megatron's bf16 optimizers (``Float16OptimizerWithFloat16Params`` and the ``DistributedOptimizer``)
    copy their fp32 main weights into the bf16 parameters by stochastic rounding (module docstring); returns
    how many inner optimizers were switched. An instance attribute shadows the class's
    ``_copy_main_params_to_model_params``; a distributed optimizer with megatron-FSDP, the precision-aware
    optimizer or FP8 parameters keeps megatron's own copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    rounder = StochasticRounder(seed)
    switched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        if isinstance(opt, DistributedOptimizer):
            if not _plain_distributed(opt):
                continue
            opt._copy_main_params_to_model_params = lambda o=opt: rounder.copy(
                _distributed_pairs(o), _adam_step(o.optimizer)
            )
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            opt._copy_main_params_to_model_params = lambda o=opt: rounder.copy(
                list(zip(*o._get_model_and_main_params_data_float16())), _adam_step(o.optimizer)
            )
        else:
            continue
        switched += 1
    return switched


def _plain_distributed(opt) -> bool:
    """A distributed optimizer whose copy is the plain shard loop :func:`_distributed_pairs` mirrors."""
    from megatron.core.fp8_utils import is_float8tensor

    if opt.ddp_config.use_megatron_fsdp or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        return False
    return not any(is_float8tensor(p) for group in opt.model_float16_groups for p in group)


def _distributed_pairs(opt) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """megatron-core 0.16.1's ``DistributedOptimizer._copy_main_params_to_model_params`` as (destination, source)
    pairs: each main shard goes to its range of the DDP bucket's param buffer, which the all-gather that follows
    the step spreads to the other DP ranks."""
    pairs = []
    for shard_groups, model_groups in (
        (opt.shard_fp32_from_float16_groups, opt.model_float16_groups),
        (opt.shard_fp32_groups, opt.model_fp32_groups),
    ):
        for shard_group, model_group in zip(shard_groups, model_groups):
            for shard_main, model_param in zip(shard_group, model_group):
                world = opt._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
                buffer = opt.buffers[gbuf_index].buckets[bucket_id].param_data
                pairs.append((buffer.view(-1)[world.start : world.end], shard_main))
    return pairs
