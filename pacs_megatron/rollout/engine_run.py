"""What an engine reads of the run beyond its own section (``rollout:``): a component takes the configs it reads.

    engine = build_engine(rollout, EngineRun(dtype="float32", max_prompt_length=512), model_dir, tokenizer, "cpu")

The loop picks these values out of a run config (``loop/build.py engine_run``); a tool passes its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineRun:
    """The policy's dtype, the prompt length, and what the actor beside the engine asks of it.

    Example:
        >>> run = EngineRun(dtype="auto", max_prompt_length=512)
        >>> run.record_routing, run.adapter_rank
        (False, 0)
    """

    dtype: str
    """``model.dtype``: "float32", "bfloat16", or "auto" (float32 on CPU, bfloat16 on accelerators)."""
    max_prompt_length: int
    """``data.max_prompt_length``: with ``rollout.max_response_length``, the longest context vLLM must hold."""
    record_routing: bool = False
    """``actor.routing_replay=rollout``: the engine records each token's routed experts (MoE) for the actor."""
    offload_actor: bool = False
    """``actor.offload_during_rollout``: the actor frees its optimizer state while the engine runs, so a vLLM
    engine on a GPU is sized from the memory free then."""
    memory_fraction: float = 0.9
    """``actor.rollout_memory_fraction``: the share of that free memory vLLM takes (with ``offload_actor``)."""
    adapter_rank: int = 0
    """``actor.lora.rank`` when the weight sync sends LoRA adapters (``sync.lora=adapter``): vLLM serves them over
    its base; 0: the sync sends whole weights."""
    adapter_targets: tuple[str, ...] = ()
    """``actor.lora.targets`` of those adapters (with ``adapter_rank`` > 0)."""

    @property
    def serves_adapters(self) -> bool:
        """Whether the engine serves LoRA adapters over its base (``sync.lora=adapter``)."""
        return self.adapter_rank > 0
