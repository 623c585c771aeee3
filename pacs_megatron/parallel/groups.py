"""Process start-up for the actor: torch.distributed, megatron's model-parallel groups, teardown.

This is the only module besides ``actor/`` that touches ``megatron.core.parallel_state``. Everything
downstream receives a frozen :class:`ParallelGroups` (and megatron's ``ProcessGroupCollection`` in
it, which megatron-core 0.16.1 accepts as ``pg_collection=`` in GPTModel, DDP, the optimizer and the
schedules), so model and loss code never asks a global for its groups.

Rank layout is megatron's default order "tp-cp-ep-dp-pp": TP ranks are adjacent (fast links inside
a node), then CP, then DP, then PP. Context parallelism splits every sequence over the CP ranks of a
replica (parallel/cp_split.py); megatron's DDP and optimizer reduce gradients over DP x CP. Expert
parallelism (MoE) does not add ranks: the EP ranks of an expert layer are drawn from the TP x DP ranks
of one pipeline stage (experts are not tensor-parallel, ``expert_tensor_parallel_size=1``), so EP must
divide TP x DP.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pacs_megatron.config import ConfigError, ParallelConfig
from pacs_megatron.parallel.cpu_patches import apply_cpu_patches, import_megatron
from pacs_megatron.parallel.layout import check_layout
from pacs_megatron.utils.devices import cuda_ordinal, memory_fraction
from pacs_megatron.utils.dist import free_port, under_launcher
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the TP x PP x CP x DP layout, and the groups to talk over.

    Example:
        >>> hf = {"num_attention_heads": 4, "num_hidden_layers": 2}
        >>> g = initialize_parallel(ParallelConfig(), hf)  # doctest: +SKIP
        >>> g.tp_size, g.is_first_stage, g.is_last_stage  # doctest: +SKIP
        (1, True, True)
    """

    tp_group: Any
    """Tensor-parallel group (vocab-parallel logits are reduced over it)."""
    pp_group: Any
    """Pipeline group (stages of one model replica)."""
    dp_group: Any
    """Data-parallel group (metrics are reduced over it; gradients over DP x CP, inside megatron's DDP)."""
    mp_group: Any
    """Model-parallel group (TP x PP: one replica)."""
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    vpp_size: int
    """Virtual pipeline stages (model chunks) per rank; 1 without interleaving."""
    rank: int
    """Global rank."""
    world_size: int
    pg_collection: Any
    """megatron.core.process_groups_config.ProcessGroupCollection of these groups."""
    device: torch.device
    """Where this rank's tensors live (cuda:LOCAL_RANK or cpu)."""
    ep_group: Any = None
    """Expert-parallel group (MoE: the ranks that split one layer's experts); None when ep=1."""
    ep_rank: int = 0
    ep_size: int = 1
    expert_dp_group: Any = None
    """Ranks holding the same experts (expert gradients are reduced over it); None when ep=1."""
    cp_group: Any = None
    """Context-parallel group (the ranks holding one sequence's chunks); None when cp=1."""
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last pipeline stage of this rank's pipeline (source of broadcasts)."""
        return dist.get_global_rank(self.pp_group, self.pp_size - 1) if self.pp_size > 1 else self.rank


def init_distributed(cfg: ParallelConfig) -> torch.device:
    """Initialise the default process group from the launcher's environment; return this rank's device.

    torchrun / srun / ``spawn_local`` set RANK, WORLD_SIZE, MASTER_ADDR/PORT and LOCAL_RANK. Without
    them (a plain single process) a world of one is set up on a free localhost port. Backend "auto"
    is nccl with GPUs, gloo otherwise. Idempotent: an existing process group is kept.
    """
    has_gpu = torch.cuda.is_available()
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if has_gpu else "gloo")
    if backend == "nccl" and not has_gpu:
        raise ConfigError("parallel.backend=nccl needs CUDA GPUs: use parallel.backend=gloo (or auto) on CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # LOCAL_RANK, or the one device of a task bound to its GPU (srun --gpus-per-task); never past the visible ones
    device = (
        torch.device("cuda", cuda_ordinal(local_rank, torch.cuda.device_count())) if has_gpu else torch.device("cpu")
    )
    if has_gpu:
        torch.cuda.set_device(device)
        share = memory_fraction()  # runs sharing this GPU (compare --jobs): each keeps to its share
        if share is not None:
            torch.cuda.set_per_process_memory_fraction(share, device)
    else:
        apply_cpu_patches()
    if dist.is_initialized():
        return device
    if not under_launcher():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(minutes=30),
        device_id=device if has_gpu else None,
    )
    return device


def initialize_parallel(cfg: ParallelConfig, hf_config: Any, training: bool = True) -> ParallelGroups:
    """Check the layout, then build megatron's TP/PP/CP/DP/EP groups (initialises torch.distributed if needed).
    ``training=False``: the model only runs forward passes (see :func:`check_layout`)."""
    import_megatron()  # first: on CPU, without building the compiled wrappers nothing calls
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    device = init_distributed(cfg)
    check_layout(cfg, hf_config, dist.get_world_size(), training)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        context_parallel_size=cfg.cp,
        virtual_pipeline_model_parallel_size=cfg.vpp if cfg.vpp > 1 else None,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=1,
    )
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    groups = ParallelGroups(
        tp_group=pgc.tp,
        pp_group=pgc.pp,
        dp_group=pgc.dp,
        mp_group=pgc.mp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=cfg.tp,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=cfg.pp,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        vpp_size=cfg.vpp,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        pg_collection=pgc,
        device=device,
        ep_group=pgc.ep if cfg.ep > 1 else None,
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=cfg.ep,
        expert_dp_group=pgc.expt_dp if cfg.ep > 1 else None,
        cp_group=pgc.cp if cfg.cp > 1 else None,
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=cfg.cp,
    )
    logger.info(
        "parallel layout: world=%d tp=%d pp=%d vpp=%d cp=%d dp=%d ep=%d (%s)",
        groups.world_size,
        cfg.tp,
        cfg.pp,
        cfg.vpp,
        cfg.cp,
        groups.dp_size,
        cfg.ep,
        dist.get_backend(),
    )
    return groups


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group (safe to call twice)."""
    try:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    except Exception as e:  # teardown must not mask the error that brought us here
        logger.debug("destroy_model_parallel: %s", e)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
