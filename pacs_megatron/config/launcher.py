"""How the ranks are started: by an outside launcher, locally, or as actors on a Ray cluster."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pacs_megatron.config.base import ConfigError, _choice, _positive


@dataclass
class LauncherConfig:
    """``launcher.kind=ray`` runs one Ray actor per rank in a placement group (launch/ray_launcher.py)."""

    kind: str = "auto"
    """"auto" (a rank under torchrun/srun, else spawn local ranks), "local", "torchrun" (must already run
    under torchrun / srun) or "ray"."""
    ray_address: str = ""
    """Ray cluster to join (kind=ray): "auto" (the cluster of this node / of ``ray job submit``),
    "HOST:PORT" of the head, or "" to start a private single-node Ray instance."""
    placement: str = "pack"
    """Placement group strategy: "pack" (consecutive ranks, hence a TP group, share a node where they
    fit), "spread", or "strict_spread" (every rank on its own node)."""
    placement_timeout_s: float = 120.0
    """How long to wait for the cluster to grant the placement group before failing."""
    cpus_per_rank: int = 1
    """CPUs reserved in each rank's bundle; also the rank's OMP_NUM_THREADS unless the launching
    shell sets OMP_NUM_THREADS."""
    gpus_per_rank: int = -1
    """GPUs in each rank's bundle: -1 (auto) = 1 when the cluster has GPUs, else 0 (CPU ranks)."""

    env: dict[str, str] = field(default_factory=dict)
    """kind=ray: variables set in every rank's environment, on top of those forwarded from the driver's
    (PACS_*, HF_*, WANDB_*, NCCL_*, GLOO_*, TORCH_*, VLLM_*, UCX_*, NVTE_*, OMP_*,
    CUDA_DEVICE_MAX_CONNECTIONS), e.g. ``launcher.env={LD_LIBRARY_PATH: /opt/nccl/lib}``."""

    def __post_init__(self) -> None:
        _choice("launcher.kind", self.kind, ("auto", "local", "torchrun", "ray"))
        bad = [k for k in self.env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k))]
        if bad:
            raise ConfigError(f"launcher.env has invalid variable names {bad}: use letters, digits and _")
        _choice("launcher.placement", self.placement, ("pack", "spread", "strict_spread"))
        _positive("launcher.placement_timeout_s", self.placement_timeout_s)
        _positive("launcher.cpus_per_rank", self.cpus_per_rank)
        if self.gpus_per_rank not in (-1, 0, 1):
            raise ConfigError(
                f"launcher.gpus_per_rank={self.gpus_per_rank}: use 1 (one GPU per rank), 0 (CPU) or -1 (auto)"
            )
