"""Typed run configuration: one dataclass per area, validated at construction.

Loaded from YAML with ``a.b.c=value`` overrides through OmegaConf structured configs::

    cfg = load_config("examples/configs/cpu_tiny.yaml", ["trainer.total_steps=5", "parallel.tp=1"])

Every field carries a docstring; ``__post_init__`` raises :class:`ConfigError` naming the field and
the fix. Checks that need the model (TP divides the heads, ...) run at start-up in ``parallel/``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pacs_megatron.pacs.config import PACSConfig, PolicyLossConfig


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the fix."""


def _choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid: choose one of {list(choices)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


@dataclass
class TinyModelConfig:
    """Shape of a randomly initialised Qwen2 model (``model.init=tiny``); vocab comes from the tokenizer."""

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


@dataclass
class ModelConfig:
    """Which model the actor trains and how it is initialised."""

    path: str = ""
    """Hugging Face model directory (config.json, *.safetensors, tokenizer). For init=tiny it is
    created (config + tokenizer of the synthetic task) when missing."""
    init: str = "pretrained"
    """"pretrained": load the safetensors in ``path``; "random": config.json only, random weights;
    "tiny": build a tiny Qwen2 from ``model.tiny`` and the task's tokenizer."""
    tokenizer: str = ""
    """Tokenizer directory; empty means ``path``."""
    dtype: str = "auto"
    """Parameter dtype: "auto" (bfloat16 on GPU, float32 on CPU), "float32" or "bfloat16"."""
    seed: int = 1234
    """Seed of random initialisation."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape used when init=tiny."""
    recompute_activations: bool = False
    """Full activation recomputation per layer (saves memory for long responses)."""

    def __post_init__(self) -> None:
        _choice("model.init", self.init, ("pretrained", "random", "tiny"))
        _choice("model.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        if not self.path:
            raise ConfigError(
                "model.path is empty: set it to a Hugging Face model directory (model.path=/ckpt/Qwen2.5-7B)"
            )


@dataclass
class ParallelConfig:
    """Megatron-Core layout: world size = tp * pp * dp."""

    tp: int = 1
    """Tensor-parallel size (must divide attention heads and KV heads)."""
    pp: int = 1
    """Pipeline-parallel size (must divide the layers, times vpp)."""
    vpp: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B); 1 disables interleaving."""
    dp: int = 1
    """Data-parallel size. A self-launched run starts tp * pp * dp local processes."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs Transformer Engine or Apex, and tp > 1)."""
    backend: str = "auto"
    """torch.distributed backend: "auto" (nccl with GPUs, gloo without), "nccl" or "gloo"."""

    def __post_init__(self) -> None:
        for k in ("tp", "pp", "vpp", "dp"):
            _positive(f"parallel.{k}", getattr(self, k))
        _choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("parallel.vpp > 1 needs parallel.pp > 1 (interleaving is a pipeline schedule)")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class VLLMConfig:
    """vLLM engine settings (rollout.engine=vllm)."""

    tensor_parallel_size: int = 1
    """vLLM's own TP (may differ from the trainer's)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take while awake (colocated with the trainer)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (faster start, slower decode)."""
    enable_sleep_mode: bool = True
    """Free vLLM's weights and KV cache while the trainer runs."""
    max_num_seqs: int = 256
    """Concurrent sequences per engine."""

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("rollout.vllm.gpu_memory_utilization must be in (0, 1], e.g. 0.5")
        _positive("rollout.vllm.tensor_parallel_size", self.tensor_parallel_size)


@dataclass
class RolloutConfig:
    """How responses are sampled."""

    engine: str = "hf"
    """"hf" (transformers; CPU default and small-GPU fallback) or "vllm" (GPU)."""
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

    def __post_init__(self) -> None:
        _choice("rollout.engine", self.engine, ("hf", "vllm"))
        _positive("rollout.n", self.n)
        _positive("rollout.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        _positive("rollout.max_response_length", self.max_response_length)
        _positive("rollout.batch_size", self.batch_size)


@dataclass
class AlgorithmConfig:
    """Which loss trains the actor, and how the batch is cut for it."""

    loss: str = "pacs"
    """"pacs" (default), or the paper's baselines "grpo" and "ppo" (PPO-clip, critic-free)."""
    pacs: PACSConfig = field(default_factory=PACSConfig)
    """PACS settings (beta, reward_method, adv_estimator, weight_mode)."""
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """GRPO / PPO-clip settings (clip ratios, loss aggregation, advantage)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    mini_batch_size: int = 0
    """Prompts per optimizer step (all their n responses); 0 means the whole train batch."""
    micro_batch_size: int = 8
    """Sequences per forward/backward, per data-parallel rank: a multiple of rollout.n, so a prompt
    group is never split (PACS needs the whole group in one loss)."""
    logprob_micro_batch_size: int = 0
    """Sequences per forward of the old-log-prob pass; 0 means micro_batch_size. Any value gives
    bit-identical log-probs on CPU (batch invariance)."""

    def __post_init__(self) -> None:
        _choice("algorithm.loss", self.loss, ("pacs", "grpo", "ppo"))
        _positive("algorithm.ppo_epochs", self.ppo_epochs)
        _positive("algorithm.mini_batch_size", self.mini_batch_size, allow_zero=True)
        _positive("algorithm.micro_batch_size", self.micro_batch_size)
        _positive("algorithm.logprob_micro_batch_size", self.logprob_micro_batch_size, allow_zero=True)

    def loss_config(self) -> PACSConfig | PolicyLossConfig:
        """The sub-config the selected loss reads, with ``policy.adv_estimator=auto`` resolved."""
        if self.loss == "pacs":
            return self.pacs
        estimator = self.policy.adv_estimator
        if estimator == "auto":
            estimator = "rloo" if self.loss == "ppo" else "grpo"
        return replace(self.policy, adv_estimator=estimator)


@dataclass
class OptimizerConfig:
    """Megatron optimizer (Adam) and learning-rate schedule."""

    lr: float = 1e-6
    """Peak learning rate (the paper: 1e-6)."""
    min_lr: float = 0.0
    """Floor of the decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global grad-norm clip; 0 disables clipping. A non-finite norm skips the step (counted)."""
    lr_warmup_steps: int = 0
    """Linear warm-up, in optimizer steps."""
    lr_decay_style: str = "constant"
    """"constant", "linear" or "cosine" (to min_lr at the last optimizer step)."""
    use_distributed_optimizer: str = "auto"
    """Shard optimizer state over DP: "auto" (on with GPUs), "true" or "false"."""

    def __post_init__(self) -> None:
        _positive("optimizer.lr", self.lr)
        _positive("optimizer.clip_grad", self.clip_grad, allow_zero=True)
        _choice("optimizer.lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine"))
        _choice(
            "optimizer.use_distributed_optimizer",
            str(self.use_distributed_optimizer).lower(),
            ("auto", "true", "false"),
        )
        self.use_distributed_optimizer = str(self.use_distributed_optimizer).lower()


@dataclass
class ArithTaskConfig:
    """The synthetic verifiable task of the CPU default: "a+b=" answered by the digits of the sum."""

    max_operand: int = 9
    """Operands are drawn from 0..max_operand."""
    modulo: int = 10
    """Answers are (a + b) % modulo, a one-token answer; 0 disables the modulo."""
    num_problems: int = 0
    """Distinct problems in the train set; 0 means all (max_operand + 1)^2 pairs."""

    def __post_init__(self) -> None:
        _positive("data.arith.max_operand", self.max_operand)
        _positive("data.arith.modulo", self.modulo, allow_zero=True)


@dataclass
class DataConfig:
    """Prompt datasets."""

    task: str = "math"
    """"math" (JSONL/parquet math problems) or "arith" (the built-in synthetic task)."""
    data_root: str = ""
    """Folder that dataset names resolve against; empty: $PACS_DATA_ROOT, else ../shared/data."""
    train_files: list[str] = field(default_factory=lambda: ["deepscaler_subset803"])
    """Train sets: names of the shared sets (math_train, deepscaler_subset803, ...) or file paths."""
    val_files: list[str] = field(default_factory=lambda: ["math500"])
    """Validation sets (names or paths) for periodic pass@k."""
    chat_template: str = "qwen2.5"
    """"qwen2.5" (ChatML, shipped in the package) or "none" (raw prompt text)."""
    max_prompt_length: int = 512
    """Prompts longer than this (in tokens) are handled per ``overlong_prompts``."""
    overlong_prompts: str = "drop"
    """"drop" (counted in the log) or "error"."""
    bad_records: str = "error"
    """Malformed rows: "error" (file, line and field named) or "skip" (counted)."""
    shuffle: bool = True
    """Shuffle each epoch, deterministically from ``seed``."""
    seed: int = 42
    """Shuffling seed."""
    arith: ArithTaskConfig = field(default_factory=ArithTaskConfig)
    """Settings of the synthetic task (task=arith)."""

    def __post_init__(self) -> None:
        _choice("data.task", self.task, ("math", "arith"))
        _choice("data.chat_template", self.chat_template, ("qwen2.5", "none"))
        _choice("data.overlong_prompts", self.overlong_prompts, ("drop", "error"))
        _choice("data.bad_records", self.bad_records, ("error", "skip"))
        _positive("data.max_prompt_length", self.max_prompt_length)
        if self.task == "math" and not self.train_files:
            raise ConfigError("data.train_files is empty: name at least one set, e.g. data.train_files=[math_train]")

    def resolved_root(self) -> Path:
        if self.data_root:
            return Path(self.data_root)
        env = os.environ.get("PACS_DATA_ROOT")
        return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


@dataclass
class RewardConfig:
    """The verifiable reward."""

    fn: str = "math"
    """"math" (math-verify), "arith" (exact match of the synthetic task) or "module.path:function"
    with signature (prompt, response, ground_truth, extra) -> float."""
    num_workers: int = 2
    """Scoring processes (math-verify's timeouts only work outside threads)."""
    timeout_s: float = 10.0
    """Per-response scoring timeout; a timeout scores 0 and is counted."""

    def __post_init__(self) -> None:
        if self.fn not in ("math", "arith") and ":" not in self.fn:
            raise ConfigError(f"reward.fn={self.fn!r}: use 'math', 'arith' or 'package.module:function'")
        _positive("reward.num_workers", self.num_workers, allow_zero=True)
        _positive("reward.timeout_s", self.timeout_s)


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
    """Max allowed per-token |engine - actor| log-prob, scaled by max(1, |logp|) (float32 rounding grows
    with the magnitude); -1: 1e-4 for float32, 5e-2 for bfloat16. Two correct fp32 implementations
    (HF transformers vs Megatron) were measured up to 1.2e-5 apart on a trained tiny model; a wrong or
    missing tensor moves log-probs by 1e-1 and more."""

    def __post_init__(self) -> None:
        _positive("sync.bucket_mb", self.bucket_mb)
        _choice("sync.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        _positive("sync.probe_sequences", self.probe_sequences, allow_zero=True)


@dataclass
class TrainerConfig:
    """The loop: length, batch, validation, checkpoints."""

    total_steps: int = 100
    """RL steps (each: rollout, update, sync)."""
    train_batch_size: int = 32
    """Prompts per step (each gets rollout.n responses)."""
    output_dir: str = "outputs/run"
    """Where metrics.jsonl, TensorBoard, rollouts, checkpoints and plots go."""
    save_freq: int = 0
    """Checkpoint every this many steps (0: only at the end and on SIGTERM/SIGUSR1)."""
    test_freq: int = 0
    """Validate (pass@k on data.val_files) every this many steps; 0 disables it."""
    resume: str = "auto"
    """"auto" (latest complete checkpoint in output_dir, if any), "never", or a checkpoint path."""
    seed: int = 42
    """Seed of everything not seeded elsewhere."""
    export_hf: bool = False
    """Also write Hugging Face safetensors with each checkpoint."""
    sft_warmup_steps: int = 0
    """Supervised steps before RL (the synthetic task uses it to learn the answer *format* only)."""
    val_n: int = 4
    """Samples per validation problem."""
    val_k: list[int] = field(default_factory=lambda: [1])
    """k values of the reported pass@k (each <= val_n)."""
    val_temperature: float = 0.6
    """Validation sampling temperature."""
    val_top_p: float = 0.95
    """Validation nucleus sampling."""
    val_max_problems: int = 0
    """Cap on problems per validation set (0: all)."""
    log_rollouts: int = 4
    """Rollout samples saved per step to rollouts.jsonl."""
    dry_run: bool = False
    """Validate the config and layout, print them, and exit before any heavy work."""

    def __post_init__(self) -> None:
        _positive("trainer.total_steps", self.total_steps, allow_zero=True)
        _positive("trainer.train_batch_size", self.train_batch_size)
        _positive("trainer.save_freq", self.save_freq, allow_zero=True)
        _positive("trainer.test_freq", self.test_freq, allow_zero=True)
        _positive("trainer.val_n", self.val_n)
        for k in self.val_k:
            if not 1 <= k <= self.val_n:
                raise ConfigError(f"trainer.val_k has {k}: each k must be in 1..trainer.val_n={self.val_n}")


@dataclass
class LoggingConfig:
    """Where and how metrics are reported (rank 0 only)."""

    level: str = "INFO"
    """Log level of the package logger."""
    tensorboard: bool = True
    """Write TensorBoard events under output_dir/tb."""
    wandb_project: str = ""
    """Also log to Weights & Biases under this project (needs `pip install wandb`)."""
    progress_bar: bool = True
    """Rich progress bar with ETA on rank 0."""

    def __post_init__(self) -> None:
        _choice("logging.level", self.level.upper(), ("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass
class RunConfig:
    """Everything one run needs. Cross-area checks live here."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="outputs/model"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        n, algo, dp = self.rollout.n, self.algorithm, self.parallel.dp
        if algo.micro_batch_size % n:
            raise ConfigError(
                f"algorithm.micro_batch_size={algo.micro_batch_size} would split a prompt group of rollout.n={n}: "
                f"use a multiple of {n}"
            )
        if algo.logprob_micro_batch_size % n:
            raise ConfigError(
                f"algorithm.logprob_micro_batch_size={algo.logprob_micro_batch_size}: use a multiple of {n}"
            )
        mini = self.mini_batch_prompts
        if self.trainer.train_batch_size % mini:
            raise ConfigError(
                f"algorithm.mini_batch_size={mini} must divide trainer.train_batch_size={self.trainer.train_batch_size}"
            )
        if mini % dp:
            raise ConfigError(f"algorithm.mini_batch_size={mini} prompts must split evenly over parallel.dp={dp} ranks")
        rows_per_rank = mini // dp * n
        for key, mbs in (
            ("micro_batch_size", algo.micro_batch_size),
            ("logprob_micro_batch_size", algo.logprob_micro_batch_size),
        ):
            if mbs and rows_per_rank % mbs:
                raise ConfigError(
                    f"algorithm.{key}={mbs} must divide the {rows_per_rank} sequences each DP rank holds per "
                    f"mini-batch (mini_batch_size/dp*n); e.g. use {n}"
                )
        if self.model.init == "tiny":
            tiny = self.model.tiny
            for k in ("num_attention_heads", "num_key_value_heads"):
                if getattr(tiny, k) % self.parallel.tp:
                    raise ConfigError(
                        f"model.tiny.{k}={getattr(tiny, k)} must be divisible by parallel.tp={self.parallel.tp}"
                    )
            if tiny.num_layers % (self.parallel.pp * self.parallel.vpp):
                raise ConfigError("model.tiny.num_layers must be divisible by parallel.pp * parallel.vpp")
        if self.data.task == "arith" and self.reward.fn == "math":
            raise ConfigError("data.task=arith is scored by reward.fn=arith (exact match), not 'math'")

    @property
    def mini_batch_prompts(self) -> int:
        return self.algorithm.mini_batch_size or self.trainer.train_batch_size


def _format_omegaconf_error(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    return f"config key {key!r}: {msg}" if key else msg


def _yaml_chain(path: Path, depth: int = 0) -> list:
    """The YAML file and the files it names under ``base:`` (relative to it), base first."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if depth > 8:
        raise ConfigError(f"config file {str(path)!r}: 'base:' chain deeper than 8 (a cycle?)")
    layer = OmegaConf.load(path)
    base = layer.pop("base", None)
    if base is None:
        return [layer]
    return _yaml_chain(path.parent / str(base), depth + 1) + [layer]


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults <- YAML file (after the file its ``base:`` key names, if any) <- ``a.b.c=value``
    overrides, validated into a :class:`RunConfig`."""
    try:
        merged = OmegaConf.structured(RunConfig)
        if path is not None:
            for layer in _yaml_chain(Path(path)):
                merged = OmegaConf.merge(merged, layer)
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"overrides must look like a.b.c=value, got {bad}")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_format_omegaconf_error(e)) from None
    except ValueError as e:
        # The algorithm's own dataclasses name themselves; name the config key instead.
        msg = str(e).replace("PACSConfig.", "algorithm.pacs.").replace("PolicyLossConfig.", "algorithm.policy.")
        raise ConfigError(msg) from None


def to_yaml(cfg: RunConfig) -> str:
    """The resolved configuration as YAML (saved beside every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from a plain dict (e.g. one saved in a checkpoint)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(d)))


__all__ = [
    "AlgorithmConfig",
    "ArithTaskConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SyncConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "VLLMConfig",
    "config_from_dict",
    "load_config",
    "to_yaml",
]
