"""Actor checkpoints with megatron's dist_checkpointing (resharding across TP/PP layouts).

Layout of a checkpoint directory (given by the trainer's CheckpointManager)::

    PATH/megatron/        dist_checkpointing: model, optimizer, LR scheduler, counters (common
                          state), per-rank RNG (ShardedObject)
    PATH/extra_state.json the trainer's JSON-able state, written by rank 0

Model tensors are saved as megatron ShardedTensors with global (layout-free) keys, so a checkpoint
written at one TP/PP/VPP loads at another. The plain (non-distributed) optimizer's Adam moments are
sharded the same way as their parameters and reshard too. The distributed optimizer (GPU default)
is saved in megatron's "fully_reshardable" format, memory-efficient variant (written for GPU, never run here). The RNG
states are restored only when the layout is unchanged (a different layout has different ranks;
with dropout 0 nothing random runs in the actor anyway).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pacs_megatron.actor.weights import unwrap
from pacs_megatron.parallel import ParallelGroups
from pacs_megatron.run.layout import StepLayout
from pacs_megatron.utils.logging import get_logger
from pacs_megatron.utils.proc import helper_process

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


def _shield_writer_queue() -> None:
    """Start the results-queue server of megatron's checkpoint writer ourselves, as a helper that
    ignores the stop signals and dies with this rank (utils/proc.py).

    dist_checkpointing's writer (megatron-core 0.16.1 ``filesystem_async._get_write_results_queue``)
    passes every save's results through a multiprocessing Manager it spawns on the first save and
    keeps in a module global. Spawned plainly, that server dies of a SIGTERM sent to the whole
    process group (``scancel``, ``kill -TERM -PGID``): the checkpoint the signal asked for then fails
    with BrokenPipeError and the steps since the last save are lost (seen in a compare run).
    """
    from multiprocessing import get_context
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        return  # already started, or a megatron without this global (then nothing to shield)
    manager = SyncManager(ctx=get_context("spawn"))  # spawn, as megatron: no fork of a torch process
    manager.start(initializer=helper_process)
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


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
    return {"tp": groups.tp_size, "pp": groups.pp_size, "vpp": groups.vpp_size, "dp": groups.dp_size}


def _model_keys(n_chunks: int) -> list[str]:
    """The checkpoint's keys of the model chunks: ``model``, or ``model0``, ``model1``, ... with VPP."""
    return ["model"] if n_chunks == 1 else [f"model{i}" for i in range(n_chunks)]


def _sharded_state(actor, is_loading: bool, with_rng: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    g = actor.groups
    sd: dict = {}
    # The GPTModels themselves (not megatron's DDP wrappers), so state-dict keys carry no "module.".
    for key, model in zip(_model_keys(len(actor.model)), (unwrap(c) for c in actor.model)):
        sd[key] = model.sharded_state_dict()
    metadata = DISTRIB_OPTIM_METADATA if actor.distributed_optimizer else None
    sd["optimizer"] = actor.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata)
    if with_rng:
        sd["rng_state"] = ShardedObject("rng_state", _rng_state(), (g.world_size,), (g.rank,), replica_id=0)
    return sd


def save_actor_checkpoint(actor, path: str | os.PathLike, extra_state: dict) -> None:
    """Collective: write model, optimizer, scheduler, counters and RNG under ``path``."""
    from megatron.core import dist_checkpointing

    g = actor.groups
    step = StepLayout(Path(path))
    target = step.megatron.path
    if g.rank == 0:
        target.mkdir(parents=True, exist_ok=True)
        step.extra_state.write_text(json.dumps(extra_state, indent=2, sort_keys=True))
    dist.barrier()
    sd = _sharded_state(actor, is_loading=False, with_rng=True)
    sd.update(
        scheduler=actor.scheduler.state_dict(),
        counters={
            "iteration": actor.iteration,
            "skipped_steps": actor.skipped_steps,
            "nan_skipped_steps": actor.nan_skipped_steps,
        },
        layout=_layout(g),
    )
    _shield_writer_queue()
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
    common = dist_checkpointing.load_common_state_dict(str(target))
    same_layout = common.get("layout") == _layout(g)
    sd = _sharded_state(actor, is_loading=True, with_rng=same_layout)
    loaded = dist_checkpointing.load(sd, str(target))
    for key, model in zip(_model_keys(len(actor.model)), (unwrap(c) for c in actor.model)):
        model.load_state_dict(loaded[key])
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
    extra_file = step.extra_state
    extra = json.loads(extra_file.read_text()) if extra_file.is_file() else {}
    dist.barrier()
    logger.info("actor checkpoint loaded from %s (iteration %d)", target, actor.iteration)
    return extra


def _restore_zero_steps(state: object) -> None:
    """Put back the Adam step megatron-core 0.16.1 drops when it is 0: its optimizers save the per-parameter
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


def load_model_weights(chunks: list, path: str | os.PathLike) -> None:
    """Collective: load only the model weights of the checkpoint at ``path`` into the GPTModel ``chunks``
    (any TP/PP layout; the optimizer state stays on disk): what ``export`` needs."""
    from megatron.core import dist_checkpointing

    keys = _model_keys(len(chunks))
    sharded = {k: c.sharded_state_dict() for k, c in zip(keys, chunks)}
    loaded = dist_checkpointing.load(sharded, str(StepLayout(Path(path)).megatron.path))
    for k, c in zip(keys, chunks):
        c.load_state_dict(loaded[k])
