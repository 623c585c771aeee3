"""Megatron DDP wrapper, optimizer (Adam) and learning-rate schedule from our typed configs.

* Gradients live in megatron DDP's contiguous fp32 buffers (``grad_reduce_in_fp32``); the DP
  all-reduce is a plain SUM because the train step uses ``calculate_per_token_loss`` (see
  train_step.py for the full gradient convention).
* Optimizer: ``get_megatron_optimizer``. The distributed optimizer (state sharded over DP) is used
  with GPUs only by default (``optimizer.use_distributed_optimizer=auto``; "true" runs it on CPU too).
  Without Apex / TE its inner optimizer is torch's Adam, whose checkpointing megatron-core 0.16.1 gets
  wrong in three places; :func:`init_adam_state` and :func:`torch_adam_load` bridge them (checkpoint.py
  calls both), so its resume is exact. bf16 parameters keep fp32 main weights inside the optimizer,
  copied into the bf16 parameters by stochastic rounding (``model.bf16_rounding``, actor/bf16_rounding.py);
  fp32 runs use the FP32 optimizer. On CPU the inner torch Adam runs its fused kernel
  (:func:`use_fused_adam`).
* Schedule: ``OptimizerParamScheduler`` with linear warm-up, then constant / linear / cosine decay to
  ``min_lr`` over :func:`total_optimizer_steps`. Megatron's convention: the scheduler advances after
  each successful update, so update k (0-based) uses lr(k) (with warm-up the first update has lr 0).
  A resumed run keeps the checkpoint's position in the schedule and this config's lr and shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pacs_megatron.config import AlgorithmConfig, ConfigError, ModelConfig, OptimizerConfig, TrainerConfig
from pacs_megatron.parallel import ParallelGroups


def use_distributed_optimizer(optimizer: OptimizerConfig, groups: ParallelGroups) -> bool:
    """``optimizer.use_distributed_optimizer``: "auto" is on with GPUs only."""
    choice = optimizer.use_distributed_optimizer
    if choice == "auto":
        return groups.device.type == "cuda"
    return choice == "true"


def total_optimizer_steps(trainer: TrainerConfig, algorithm: AlgorithmConfig) -> int:
    """Optimizer updates of the whole run: RL steps x mini-batches x ppo_epochs + SFT warm-up steps."""
    mini_batch_prompts = algorithm.mini_batch_size or trainer.train_batch_size
    per_rl_step = (trainer.train_batch_size // mini_batch_prompts) * algorithm.ppo_epochs
    return trainer.total_steps * per_rl_step + trainer.sft_warmup_steps


def wrap_ddp(chunks: list, config, optimizer: OptimizerConfig, groups: ParallelGroups) -> list:
    """Wrap chunks in megatron DDP and install the no-sync / finalize hooks the schedules call; ``optimizer``
    says whether the gradient buffers are laid out for the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer(optimizer, groups),
        bucket_size=None,
    )
    wrapped = [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            # Only the first chunk gets buckets (megatron does the same for vpp).
            disable_bucketing=i > 0,
            pg_collection=groups.pg_collection,
        )
        for i, chunk in enumerate(chunks)
    ]
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(
    wrapped: list, optimizer: OptimizerConfig, model: ModelConfig, groups: ParallelGroups, dtype: torch.dtype
):
    """megatron's optimizer (a ChainedOptimizer) for the DDP-wrapped chunks: Adam and clipping from
    ``optimizer``; ``model`` gives the bf16 rounding of the update and its seed."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    o = optimizer
    ocfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=use_distributed_optimizer(optimizer, groups),
    )
    if ocfg.use_distributed_optimizer:
        # The distributed optimizer's checkpointing wants megatron's gloo DP groups, which 0.16.1
        # cannot take through pg_collection: let it read parallel_state (written for GPU, never run here).
        built = get_megatron_optimizer(ocfg, wrapped)
    else:
        built = get_megatron_optimizer(ocfg, wrapped, use_gloo_process_groups=False, pg_collection=groups.pg_collection)
    if groups.device.type == "cpu":
        use_fused_adam(built)
    if dtype == torch.bfloat16 and model.bf16_rounding == "stochastic":  # actor/bf16_rounding.py: why
        from pacs_megatron.actor.bf16_rounding import use_stochastic_rounding

        use_stochastic_rounding(built, model.seed)
    return built


def use_fused_adam(optimizer) -> None:
    """Switch megatron's inner ``torch.optim.Adam(W)`` (what it builds without Apex / TE, with torch's
    multi-tensor default) to torch's fused kernel: one pass over each tensor instead of a dozen foreach
    ops. On CPU for SmolLM2's 134.5M fp32 parameters, one thread: 0.75-0.79 s -> 0.10-0.12 s CPU per
    step (2026-11-25). The update rule is the same (float rounding aside)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                group.update(fused=True, foreach=None)


def build_scheduler(optimizer, o: OptimizerConfig, optimizer_steps: int):
    """OptimizerParamScheduler of ``o``'s lr shape over the run's ``optimizer_steps`` (constant weight decay)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    total = max(1, optimizer_steps)
    if o.lr_warmup_steps >= total and o.lr_warmup_steps > 0:
        raise ConfigError(
            f"optimizer.lr_warmup_steps={o.lr_warmup_steps} must be below the run's {total} optimizer steps "
            "(trainer.total_steps x mini-batches x ppo_epochs + trainer.sft_warmup_steps)"
        )
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.lr_warmup_steps else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_steps,
        lr_decay_steps=total,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
        # On resume the checkpoint restores only the schedule's position (num_steps): lr, min_lr,
        # warm-up, decay length and style come from this run's config, so a changed lr applies.
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def clip_and_step(optimizer) -> tuple[bool, float]:
    """megatron's ``optimizer.step()`` taken apart so each part runs ONCE per step, with a skip on a
    non-finite gradient norm: ``(stepped, grad_norm)``.

    megatron-core 0.16.1's ``ChainedOptimizer.step`` itself runs ``prepare_grads()`` (copy model grads to
    main grads, unscale) and the grad-norm all-reduce, and steps even when that norm is NaN (bf16 has no
    grad scaler to catch it); calling ``prepare_grads`` + ``get_grad_norm`` before ``step()`` to check
    the norm ran both twice. Here: prepare_grads -> found_inf? -> norm -> finite? -> clip with that norm
    (``clip_grad_by_total_norm_fp32``, as megatron does) -> ``step_with_ready_grads``.
    """
    # looked up on megatron's optimizer module, where parallel/cpu_patches.py installs its CPU stand-in
    from megatron.core.optimizer import optimizer as megatron_optimizer

    if optimizer.prepare_grads():  # fp16 loss scaling found inf/nan (the scaler already backed off)
        return False, float("nan")
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        return False, grad_norm
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if params:
            megatron_optimizer.clip_grad_by_total_norm_fp32(
                params,
                max_norm=opt.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    return bool(optimizer.step_with_ready_grads()), grad_norm


ADAM_STATE = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
"""The state a fresh Adam creates; anything else an optimizer keeps per parameter (TE's FusedAdam keeps fp32
master weights there with a precision-aware optimizer) is weights, not state to forget."""


@torch.no_grad()
def reset_optimizer_state(optimizer) -> None:
    """Re-initialise the inner optimizers' Adam state in place (PACS v2's and ProRL's hard reset): the moments
    and the step count (per parameter, as torch's Adam keeps it, or per group, as Apex / TE's FusedAdam do) to
    0, exactly the state a fresh Adam creates at its first step (it then counts step 1 and bias-corrects
    from there). In place, not ``state.clear()``: megatron's optimizers and checkpoints keep references to
    these tensors, and a checkpoint written before the next update must hold the same structure (see
    actor/checkpoint.py for the step 0 megatron drops). Main (fp32) weights are kept; the lr schedule is the
    scheduler's and keeps its position."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            for key in ADAM_STATE:
                if torch.is_tensor(state.get(key)):
                    state[key].zero_()
                elif key in state:
                    state[key] = 0
        for group in inner.param_groups:
            if "step" in group:
                group["step"] = group["step"].zero_() if torch.is_tensor(group["step"]) else 0


def apply_lr_config(optimizer, scheduler, o: OptimizerConfig) -> None:
    """After a checkpoint load: ``o``'s peak and floor lr replace the checkpoint's. Megatron
    keeps them per param group (``max_lr`` / ``min_lr``, restored with the optimizer state), where
    they win over the scheduler's own; the schedule's position is kept."""
    for group in optimizer.param_groups:
        if "max_lr" in group:
            group["max_lr"] = o.lr
        if "min_lr" in group:
            group["min_lr"] = o.min_lr
    scheduler.step(increment=0)  # recompute every group's lr at the current step


def _torch_adams(optimizer) -> list:
    """megatron's DistributedOptimizers whose inner optimizer is torch's Adam(W) (no Apex / TE)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [
        opt
        for opt in getattr(optimizer, "chained_optimizers", [optimizer])
        if isinstance(opt, DistributedOptimizer) and isinstance(opt.optimizer, (torch.optim.Adam, torch.optim.AdamW))
    ]


@torch.no_grad()
def init_adam_state(optimizer) -> None:
    """Give every parameter of a distributed optimizer's torch Adam that has no state yet the state its first
    ``step()`` would create: step 0 (on the parameter's device when fused, as torch keeps it) and zero moments.
    Adam's update is then the same as from no state (torch only fills an empty state; a step-0 state is what
    :func:`reset_optimizer_state` leaves, too).

    Why: megatron-core 0.16.1's ``DistributedOptimizer.state_dict`` (distrib_optimizer.py, "Extract 'step',
    for non-Apex/TE support") asserts that the per-parameter steps hold exactly one value, and its
    ``sharded_state_dict`` calls it at save and at load; a torch Adam that never stepped has no steps, so
    loading a checkpoint into a fresh actor failed there (``assert len(steps) == 1``). megatron's own
    ``init_state_fn`` (optimizer/__init__.py) creates the moments but not the step."""
    for opt in _torch_adams(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            on_param = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                state = inner.state[p]
                if state:
                    continue
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_param else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _set_states_but_step(opt, set_states, model_param, tensors: dict) -> None:
    """megatron's ``_set_main_param_and_optimizer_states`` with torch Adam's per-parameter step left out of
    the copy: it copies every key of the live state from the loaded tensors, which never hold the step
    (megatron restores it from the param groups), so it raised ``KeyError: 'step'``."""
    if "step" in tensors:
        return set_states(model_param, tensors)
    group_index, group_order = opt.model_param_group_index_map[model_param]
    state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
    step = state.pop("step", None)
    try:
        return set_states(model_param, tensors)
    finally:
        if step is not None:
            state["step"] = step


@contextmanager
def torch_adam_load(optimizer) -> Iterator[None]:
    """Around ``optimizer.load_state_dict`` of a distributed optimizer over torch's Adam (no Apex / TE): two
    fixes of megatron-core 0.16.1's load (``DistributedOptimizer.load_state_dict``, then
    ``load_parameter_state_from_fully_reshardable``):

    * the loaded moments are copied without the step (:func:`_set_states_but_step`), which raised
      ``KeyError: 'step'``;
    * megatron puts ONE step tensor into every parameter's state (``s["step"] = step`` for all of them) and
      torch's ``load_state_dict`` keeps it shared, so each Adam step then added 1 to it once per parameter
      (``torch._foreach_add_`` over the list of steps): the bias correction drifted from the first step after
      a resume. After the load every parameter gets a step tensor of its own, of the loaded value.
    """
    opts = _torch_adams(optimizer)
    for opt in opts:  # an instance attribute, shadowing the class's method for this load only
        set_states = opt._set_main_param_and_optimizer_states
        opt._set_main_param_and_optimizer_states = lambda p, t, o=opt, f=set_states: _set_states_but_step(o, f, p, t)
    try:
        yield
    finally:
        for opt in opts:
            del opt._set_main_param_and_optimizer_states
            for state in opt.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
