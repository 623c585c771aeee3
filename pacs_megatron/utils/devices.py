"""Which CUDA device a rank drives, from what its launcher made visible (torchrun, Slurm's GPU binding)."""

from __future__ import annotations

import os
from collections.abc import Mapping


def gpu_bound_per_task(environ: Mapping[str, str] | None = None, visible: int | None = None) -> bool:
    """Whether the launcher gave this task its own GPU(s) (Slurm ``--gpus-per-task`` or ``--gpu-bind``
    other than none, or fewer visible devices than ranks on the node), so that ``LOCAL_RANK`` is no
    index into what the task sees."""
    env = os.environ if environ is None else environ
    bind = env.get("SLURM_GPU_BIND", "").lower()
    if env.get("SLURM_GPUS_PER_TASK") or (bind and not bind.startswith("none")):
        return True
    local_world = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    return visible is not None and 0 < visible < local_world


def cuda_ordinal(local_rank: int, visible: int, environ: dict | None = None) -> int:
    """The CUDA device this rank uses among the ``visible`` ones: ``LOCAL_RANK`` when the task sees
    the node's GPUs, the one visible device when the task is bound to it; raises ConfigError with one
    line otherwise (never an ordinal past the visible count)."""
    from pacs_megatron.config import ConfigError

    env = os.environ if environ is None else environ
    seen = f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
    if gpu_bound_per_task(env, visible):
        if visible == 1:
            return 0
        raise ConfigError(
            f"this task is bound to {visible} GPUs ({seen}) but a rank drives one: request one GPU per task "
            "(srun --gpus-per-task=1), or give each task every GPU of its node and no --gpu-bind"
        )
    if local_rank < visible:
        return local_rank
    raise ConfigError(
        f"LOCAL_RANK={local_rank} but this task sees {visible} GPU(s) ({seen}): start at most {visible} "
        "rank(s) per node (NPROC_PER_NODE / --nproc-per-node), or make every GPU visible to each task"
    )
