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


MEMORY_FRACTION_ENV = "PACS_CUDA_MEMORY_FRACTION"
"""Set by a launcher that puts several runs on one GPU (``pacs-megatron compare --jobs``): the share of the
device's memory this process may hold (``torch.cuda.set_per_process_memory_fraction``)."""


def memory_fraction(environ: Mapping[str, str] | None = None) -> float | None:
    """The share of its GPU this process may hold, from ``PACS_CUDA_MEMORY_FRACTION`` (None: all of it)."""
    from pacs_megatron.config import ConfigError

    text = (os.environ if environ is None else environ).get(MEMORY_FRACTION_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{MEMORY_FRACTION_ENV}={text!r} must be a fraction in (0, 1]: unset it to use the whole GPU")
    return value


def share_gpus(jobs: int, ranks_per_run: int, gpus: list[str]) -> tuple[int, float | None]:
    """How ``jobs`` concurrent runs of ``ranks_per_run`` ranks share the visible ``gpus``: (runs on one GPU,
    each process's memory fraction, None when no GPU is shared). The fraction leaves 15 % of the GPU
    outside the caching allocators, for what they do not count: each process's CUDA context, cuBLAS and
    cuDNN workspaces and NCCL buffers (~1-1.5 GB each; docs/benchmarks.md, "How compare sizes concurrent
    runs")."""
    if not gpus:
        return 0, None
    per_gpu = -(-jobs * ranks_per_run // len(gpus))
    return per_gpu, (round(0.85 / per_gpu, 4) if per_gpu > 1 else None)


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this process may give out, by the ids CUDA_VISIBLE_DEVICES takes (nvidia-smi's count when
    it is unset; no CUDA initialisation in this process)."""
    import shutil
    import subprocess

    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        return [d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip() and d.strip() != "-1"]
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]


def rank_memory_bytes(device_type: str, environ: Mapping[str, str] | None = None) -> int:
    """The memory one rank may count on: a GPU's own (the current device's total); on a CPU the host's,
    shared by the node's local ranks (``LOCAL_WORLD_SIZE``)."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    import psutil

    env = os.environ if environ is None else environ
    return int(psutil.virtual_memory().total) // max(int(env.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
