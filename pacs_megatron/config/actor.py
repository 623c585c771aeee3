"""``actor.*``: the actor's memory between phases (what it gives back while the rollout engine runs) and
its LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, field

from pacs_megatron.config.base import ConfigError

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron's names of the attention and MLP linears an adapter may wrap (actor/lora/adapters.py)."""


@dataclass
class LoRAConfig:
    """``actor.lora.*``: low-rank adapters on the actor's linears, the base frozen (actor/lora/adapters.py,
    docs/lora.md). Off unless ``rank`` > 0."""

    rank: int = 0
    """Adapter rank r (0: no LoRA, full fine-tuning)."""
    alpha: float = 16.0
    """Scaling numerator: the adapter adds (alpha / rank) * B A x, as PEFT's ``lora_alpha``."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's ``lora_dropout``); 0 keeps a step deterministic."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Megatron names of the linears to adapt: any of linear_qkv, linear_proj (attention), linear_fc1,
    linear_fc2 (MLP). MoE experts' linears are not adapted."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"actor.lora.rank={self.rank} must be >= 0 (0: no LoRA)")
        if not self.alpha > 0:
            raise ConfigError(f"actor.lora.alpha={self.alpha} must be > 0 (e.g. 2 x rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"actor.lora.dropout={self.dropout} must be in [0, 1)")
        self.targets = list(self.targets)
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ConfigError(f"actor.lora.targets={self.targets}: choose from {list(LORA_TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class ActorConfig:
    """``actor.*``: GPU memory of the colocated actor during rollouts (see actor/offload.py)."""

    offload_during_rollout: bool = False
    """Between the update and the next old-log-prob pass, move the optimizer state (Adam moments and
    fp32 main params) to pinned host memory and free the grad buffer; both come back before the
    next use (train step, checkpoint). On CUDA this frees ~25 GB per rank for Qwen2.5-7B at TP=2 x
    DP=4; on CPU it runs the same code (storages freed and restored) and saves host memory only."""
    rollout_memory_fraction: float = 0.9
    """With ``offload_during_rollout`` and vLLM: the fraction of the GPU memory free after the
    offload (measured when the engine is built) that vLLM may take for weights, activations and
    KV cache; replaces ``rollout.vllm.gpu_memory_utilization`` (a fraction of the whole GPU)."""

    routing_replay: str = "none"
    """MoE models: "rollout" makes the actor's old-log-prob and training forwards use the experts the
    rollout engine chose for each token (recorded by the engine, carried in the batch) instead of
    routing again (R3, rollout routing replay); the router still gets gradients through the chosen
    experts' scores. "none": the actor routes on its own."""

    offload_reference: bool = False
    """With algorithm.kl_loss_coef > 0: keep the frozen reference policy's weights in host memory and bring
    them to the device only for its log-prob pass (actor/reference.py); saves their size (params x 2 bytes
    in bf16, per rank) during rollout and training at the cost of two copies per step."""

    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (``actor.lora.rank`` > 0): only they train; the base weights stay frozen."""

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            self.lora = LoRAConfig(**self.lora)
        if self.routing_replay not in ("none", "rollout"):
            raise ConfigError(f"actor.routing_replay={self.routing_replay!r}: use 'none' or 'rollout'")
        if not 0.0 < self.rollout_memory_fraction <= 1.0:
            raise ConfigError(
                f"actor.rollout_memory_fraction={self.rollout_memory_fraction} must be in (0, 1]: e.g. 0.9"
            )
