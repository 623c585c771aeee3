"""Actor checkpoints with megatron's dist_checkpointing (resharding across TP/PP layouts).

Layout of a checkpoint directory (given by the trainer's CheckpointManager)::

    PATH/megatron/        dist_checkpointing: model, optimizer, LR scheduler, counters (common
                          state), per-rank RNG (ShardedObject)
    PATH/extra_state.json the trainer's JSON-able state, written by rank 0

Model tensors are saved as megatron ShardedTensors with global (layout-free) keys, so a checkpoint
written at one TP/PP/VPP loads at another. The plain (non-distributed) optimizer's Adam moments are
sharded the same way as their parameters and reshard too. The distributed optimizer (GPU default)
is saved in megatron's "fully_reshardable" format, memory-efficient variant (run on CPU with torch's Adam:
tests/actor/test_distopt_resume.py; with Apex / TE's FusedAdam, never run here). The RNG
states are restored only when the layout is unchanged (a different layout has different ranks;
with dropout 0 nothing random runs in the actor anyway).

LoRA (``actor.lora.rank`` > 0; docs/lora.md): the frozen base is left out. The checkpoint holds the
adapters, their optimizer state and everything else above, plus the adapters every PACS v2 reset merged into
the base (``lora_merges.K.*``, sharded as the adapters); ``extra_state.json`` names the base model and a hash
of its weights (run/checkpoint_base.py). A load checks the hash (one line on a mismatch), keeps the base the
actor was built with and replays the merges onto it in the order and arithmetic of the resets
(``lora.replay_merges``): bit for bit at the same layout. Once the merges take as many bytes as the base, a
checkpoint holds the merged base instead (as before this change), and so do the later ones.
"""

from __future__ import annotations

import json
import os
import queue
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pacs_megatron.actor.lora import checkpoint as lora_ckpt
from pacs_megatron.actor.optimizer import init_adam_state, torch_adam_load
from pacs_megatron.actor.weights import load_hf_weights, unwrap
from pacs_megatron.parallel import ParallelGroups
from pacs_megatron.run.checkpoint_base import LORA_KEY, lora_record
from pacs_megatron.run.layout import StepLayout
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

# Distributed optimizer: "fully_reshardable" (loads at any TP/PP/DP) in its memory-efficient variant.
# Without the flag megatron all-gathers every rank's fp32 param + exp_avg + exp_avg_sq of its whole TP x PP
# shard into host memory on EVERY rank (~46 GB per rank for 7B at TP=2); with it the shards are gathered
# over the gloo DP group onto DP rank 0 only (megatron-core 0.16.1 distrib_optimizer.py,
# sharded_param_state_fully_reshardable). Same checkpoint semantics; save is no longer parallel over DP.
DISTRIB_OPTIM_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
}


def _in_process_writer_queue() -> None:
    """Give megatron's checkpoint writer an in-process results queue instead of the Manager it spawns.

    dist_checkpointing's writer (megatron-core 0.16.1 ``filesystem_async``) passes a save's results through a
    module-global ``_results_queue``, by default a queue served by a ``multiprocessing`` Manager that it
    spawns on the first save. That server is a bare interpreter: the first ``put`` of the write results
    (torch objects) makes it import torch and torch.distributed.checkpoint, which held every rank's first
    save for 7-8 s (2 cores, measured 2026-11-28: 6.9 s of a 7.3 s save, 0.3 s for the second one); and a
    SIGTERM sent to the process group (``scancel``, ``kill -TERM -PGID``) killed it, failing the checkpoint
    the signal asked for. The Manager exists for megatron's async saves, whose writer runs in another
    process. This project saves synchronously (``dist_checkpointing.save``): the writer's forked workers
    report through their own local queue and the aggregate is put and read back in this process, so a
    thread-safe ``queue.Queue`` carries it with no helper process at all.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:  # not set yet (and the global exists)
        filesystem_async._results_queue = queue.Queue()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _layout(groups: ParallelGroups) -> dict:
    layout = {"tp": groups.tp_size, "pp": groups.pp_size, "vpp": groups.vpp_size, "dp": groups.dp_size}
    # only when on: checkpoints written before parallel.cp existed keep comparing equal
    return layout | ({"cp": groups.cp_size} if groups.cp_size > 1 else {})


def _model_keys(n_chunks: int) -> list[str]:
    """The checkpoint's keys of the model chunks: ``model``, or ``model0``, ``model1``, ... with VPP."""
    return ["model"] if n_chunks == 1 else [f"model{i}" for i in range(n_chunks)]


def _sharded_state(actor, is_loading: bool, with_rng: bool, lora: dict | None = None) -> tuple[dict, list]:
    """The sharded state to save or load into, and (LoRA, adapters only) where each merged adapter goes."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    g = actor.groups
    if actor.distributed_optimizer:  # megatron reads torch Adam's steps at save and load (actor/optimizer.py)
        init_adam_state(actor.optimizer)
    keys, models = _model_keys(len(actor.model)), [unwrap(c) for c in actor.model]
    # The GPTModels themselves (not megatron's DDP wrappers), so state-dict keys carry no "module.".
    sd: dict = {key: model.sharded_state_dict() for key, model in zip(keys, models)}
    if lora_ckpt.adapters_only(lora):  # the frozen base is named in extra_state.json, not saved
        sd = {key: lora_ckpt.model_entries(sd[key]) for key in keys}
    metadata = DISTRIB_OPTIM_METADATA if actor.distributed_optimizer else None
    sd["optimizer"] = actor.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata)
    if with_rng:
        sd["rng_state"] = ShardedObject("rng_state", _rng_state(), (g.world_size,), (g.rank,), replica_id=0)
    where: list = []
    if lora_ckpt.adapters_only(lora) and lora and lora.get("merges"):
        sd[lora_ckpt.MERGES], where = lora_ckpt.merge_entries(models, keys, sd, len(lora["merges"]), is_loading)
    return sd, where


def save_actor_checkpoint(actor, path: str | os.PathLike, extra_state: dict) -> None:
    """Collective: write model, optimizer, scheduler, counters and RNG under ``path``."""
    from megatron.core import dist_checkpointing

    g = actor.groups
    step = StepLayout(Path(path))
    target = step.megatron.path
    lora = lora_ckpt.save_record(actor)
    if g.rank == 0:
        target.mkdir(parents=True, exist_ok=True)
        extra = extra_state if lora is None else {**extra_state, LORA_KEY: lora}
        step.extra_state.write_text(json.dumps(extra, indent=2, sort_keys=True))
    dist.barrier()
    sd, _ = _sharded_state(actor, is_loading=False, with_rng=True, lora=lora)
    sd.update(
        scheduler=actor.scheduler.state_dict(),
        counters={
            "iteration": actor.iteration,
            "skipped_steps": actor.skipped_steps,
            "nan_skipped_steps": actor.nan_skipped_steps,
        },
        layout=_layout(g),
    )
    _in_process_writer_queue()
    dist_checkpointing.save(sd, str(target))
    dist.barrier()
    logger.info("actor checkpoint written to %s (iteration %d)", target, actor.iteration)


def load_actor_checkpoint(actor, path: str | os.PathLike) -> dict:
    """Collective: restore what :func:`save_actor_checkpoint` wrote (any TP/PP layout); return the
    trainer's extra state."""
    from megatron.core import dist_checkpointing

    g = actor.groups
    step = StepLayout(Path(path))
    target = step.megatron.path
    if not step.megatron.metadata_json.is_file():
        raise FileNotFoundError(f"{target} is not a megatron dist checkpoint (no metadata.json)")
    extra = json.loads(step.extra_state.read_text()) if step.extra_state.is_file() else {}
    lora = lora_record(extra)
    lora_ckpt.check_load(actor, step, lora)
    common = dist_checkpointing.load_common_state_dict(str(target))
    same_layout = common.get("layout") == _layout(g)
    sd, where = _sharded_state(actor, is_loading=True, with_rng=same_layout, lora=lora)
    loaded = dist_checkpointing.load(sd, str(target))
    models = [unwrap(c) for c in actor.model]
    reread = (
        (lambda: load_hf_weights(actor.model, actor.spec, actor.model_dir, g))
        if actor.sections.model.loads_weights
        else None
    )
    lora_ckpt.load_model(models, _model_keys(len(models)), loaded, lora, where, reread)
    if actor.distributed_optimizer:
        with torch_adam_load(actor.optimizer):
            actor.optimizer.load_state_dict(loaded["optimizer"])
    else:
        _restore_zero_steps(loaded["optimizer"])
        actor.optimizer.load_state_dict(loaded["optimizer"])
    actor.scheduler.load_state_dict(common["scheduler"])
    actor.iteration = int(common["counters"]["iteration"])
    actor.skipped_steps = int(common["counters"]["skipped_steps"])
    actor.nan_skipped_steps = int(common["counters"].get("nan_skipped_steps", 0))  # absent before 2026-11
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    else:
        logger.info("checkpoint layout %s differs from %s: RNG states not restored", common.get("layout"), _layout(g))
    dist.barrier()
    logger.info("actor checkpoint loaded from %s (iteration %d)", target, actor.iteration)
    return extra


def _restore_zero_steps(state: object) -> None:
    """Put back the Adam step megatron-core 0.16.1's plain optimizers drop when it is 0: they save the per-parameter
    step once, as ``common_step``, under ``if step:``, so a step tensor of 0 (the state right after a
    reference reset re-initialised the optimizer, actor/optimizer.py) is not saved, and torch's Adam then
    refuses the loaded state (KeyError 'step'). A per-parameter Adam state with moments and no step can only
    come from that: it gets step 0 back."""
    if isinstance(state, dict):
        for value in state.values():
            if (
                isinstance(value, dict)
                and "exp_avg" in value
                and "step" not in value
                and torch.is_tensor(value["exp_avg"])
            ):
                value["step"] = torch.zeros((), dtype=torch.float32, device=value["exp_avg"].device)
            else:
                _restore_zero_steps(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            _restore_zero_steps(value)


def load_model_weights(chunks: list, path: str | os.PathLike, load_base: Callable[[], None] | None = None) -> None:
    """Collective: load only the model weights of the checkpoint at ``path`` into the GPTModel ``chunks``
    (any TP/PP layout; the optimizer state stays on disk): what ``export`` needs. A LoRA checkpoint that holds
    only the adapters needs the base first: ``load_base()`` puts it into the chunks (pretrained weights; a
    random base is drawn when the chunks are built), then the merges of its v2 resets are replayed onto it
    (the caller checked the base's hash, run/checkpoint_base.py)."""
    from megatron.core import dist_checkpointing

    step = StepLayout(Path(path))
    lora = lora_record(json.loads(step.extra_state.read_text()) if step.extra_state.is_file() else {})
    keys = _model_keys(len(chunks))
    sharded = {k: c.sharded_state_dict() for k, c in zip(keys, chunks)}
    lora_ckpt.check_legacy(step, lora, any(".lora_" in k for sd in sharded.values() for k in sd))
    where: list = []
    if lora_ckpt.adapters_only(lora):
        sharded = {k: lora_ckpt.model_entries(sharded[k]) for k in keys}
        if lora and lora.get("merges"):
            sharded[lora_ckpt.MERGES], where = lora_ckpt.merge_entries(chunks, keys, sharded, len(lora["merges"]), True)
        if load_base is not None:
            load_base()
    loaded = dist_checkpointing.load(sharded, str(step.megatron.path))
    lora_ckpt.load_model(chunks, keys, loaded, lora, where)
