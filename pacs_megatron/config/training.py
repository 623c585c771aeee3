"""Algorithm, optimizer, trainer-loop and logging settings."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pacs_megatron.config.base import ConfigError, _choice, _positive
from pacs_megatron.config.switches import OverlongConfig, check_algorithm_switches
from pacs_megatron.config.warmup import WarmupStopConfig
from pacs_megatron.pacs.config import (
    GSPOConfig,
    PACSConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    check_ratio_bounds,
    split_correction,
)
from pacs_megatron.pacs.registry import LossTraits, get_loss


@dataclass
class AlgorithmConfig:
    """Which loss trains the actor, and how the batch is cut for it."""

    loss: str = "pacs"
    """"pacs" (default), or the paper's baselines "grpo" and "ppo" (PPO-clip; critic-free unless
    policy.adv_estimator=gae, the learned critic of ``critic:``), or "gspo" (sequence-level ratio,
    Qwen's GSPO, settings in ``gspo``), or any other loss registered in pacs/registry.py."""
    pacs: PACSConfig = field(default_factory=PACSConfig)
    """PACS settings (beta, reward_method, adv_estimator, weight_mode)."""
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """GRPO / PPO-clip settings (clip ratios, loss aggregation, advantage)."""
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    """GSPO settings: the same fields as ``policy`` with verl's GSPO defaults (clip 3e-4 / 4e-4,
    seq-mean-token-mean, GRPO advantages)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    mini_batch_size: int = 0
    """Prompts per optimizer step (all their n responses); 0 means the whole train batch."""
    micro_batch_size: int = 8
    """Sequences (not tokens) per forward/backward, per data-parallel rank: a multiple of rollout.n, so a
    prompt group is never split (PACS needs the whole group in one loss), dividing the sequences a rank
    holds per mini-batch. With dynamic_batching it also sizes the default token budget
    (max_tokens_per_micro_batch=0: micro_batch_size x the padded longest sequence)."""
    logprob_micro_batch_size: int = 0
    """Sequences per forward of the old-log-prob pass; 0 means micro_batch_size. Any value gives
    bit-identical log-probs on CPU (batch invariance)."""
    old_logp_from_forward: bool = True
    """The first mini-batch of a step is trained while pi_theta = pi_old: take its old log-probs from its
    own training forward (detached) instead of a separate no-grad pass, which then covers the other
    mini-batches only (none with one update per step). Same loss and gradient (the batch-invariant
    kernel gives the pass's values bit for bit, tests/actor/test_old_logp_from_forward.py); saves a
    forward over the mini-batch. Ignored (the pass covers every row) with ``rollout_correction``, whose
    weights need pi_old before the first loss. False: the separate pass over every row."""
    rollout_correction: str = "none"
    """Correct the rollout/actor mismatch (e.g. FP8 or bf16 rollouts) with ratios pi_old / pi_rollout:
    "none", or "+"-joined parts that compose (e.g. "tis+icepop+geo"): at most one importance weight,
    "tis" (truncated: min(ratio, is_cap)) or "mis" (masked: ratio, zeroed outside [1/is_cap, is_cap]),
    and any rejection masks: "icepop" (tokens outside icepop_bounds), "geo" (rows whose geometric-mean
    ratio is outside geo_bounds), "outlier" (rows with a token outside outlier_bounds). A masked unit gets
    weight 0 and leaves the loss; for PACS a masked token drops its row. See pacs/rollout_correction.py
    and docs/fp8.md."""
    is_cap: float = 2.0
    """Cap C of the importance ratio (> 1): tis truncates at C, mis drops units outside [1/C, C]."""
    icepop_bounds: list[float] = field(default_factory=lambda: [0.5, 2.0])
    """rollout_correction "icepop": [low, high] of the token ratio outside which a token is masked
    (IcePop's and SkyRL's [0.5, 2]); 0 <= low < 1 < high."""
    geo_bounds: list[float] = field(default_factory=lambda: [0.99, 1.01])
    """rollout_correction "geo": [low, high] of a row's geometric-mean ratio exp(mean_t log ratio_t)
    outside which the row is masked (verl's and SkyRL's [0.99, 1.01])."""
    outlier_bounds: list[float] = field(default_factory=lambda: [1e-4, 100.0])
    """rollout_correction "outlier": a row with any token ratio outside [low, high] is masked (SkyRL's
    suggested 1e-4 / 100; verl's token veto is the low bound alone: set high=.inf; low=0 is no low bound)."""
    is_level: str = "auto"
    """Unit of the importance ratio: "token", "sequence" (product over the response), or "auto":
    sequence for pacs (its weight multiplies a row's BCE weight), token for grpo/ppo."""
    dynamic_batching: bool = True
    """Padding-free batching (docs/batching.md): micro-batches of whole prompt groups under
    max_tokens_per_micro_batch padded tokens, each padded only to its own longest row, groups spread
    over DP ranks by tokens; the old-log-prob pass uses the training pass's micro-batches (so
    logprob_micro_batch_size is unused). Same gradient as fixed batching; false: fixed micro-batches
    of micro_batch_size rows padded to the step's longest row."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of a dynamic micro-batch per DP rank (rows x padded length, padding included);
    0: micro_batch_size x (data.max_prompt_length + rollout.max_response_length, rounded up to 8),
    i.e. never more than a fixed micro-batch can hold."""
    # The recipe switches (config/switches.py, docs/baselines.md), all off by default.
    filter_groups: str = "none"
    """Dynamic sampling (DAPO): "none" trains every group; "mixed" keeps only groups whose verifiable rewards
    are not all equal and generates more prompts (up to max_gen_batches rounds) until train_batch_size groups
    are kept. Off for PACS recipes: an all-equal group still gives PACS a gradient (weight 1)."""
    max_gen_batches: int = 10
    """filter_groups: generation rounds per step at most (the first included), verl's max_num_gen_batches."""
    gen_batch_size: int = 0
    """filter_groups: prompts drawn per generation round; 0: train_batch_size in the first round, the
    shortfall after it. Prompts drawn past the step's last trained group go back to the prompt stream."""
    short_batch: str = "train"
    """filter_groups, when max_gen_batches rounds keep fewer than train_batch_size groups: "train" on the
    whole mini-batches kept (a warning says how many), or "fail" (verl's behaviour)."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO's soft overlong punishment and truncated-response masking (pacs/overlong.py)."""
    kl_loss_coef: float = 0.0
    """Weight of a KL term to a frozen reference policy (the policy RL starts from) in the loss, verl's
    actor.kl_loss_coef; 0: no reference model is built and nothing is computed (actor/reference.py)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator per token (pacs/regularizers.py): "k1"/"kl" (logp - ref), "abs", "k2"/"mse"
    (0.5 (logp - ref)^2), "k3"/"low_var_kl" (exp(ref - logp) - (ref - logp) - 1), or with "+" (k1+, k3+)
    for k2's gradient under that value."""
    entropy_coeff: float = 0.0
    """Weight of the token-entropy bonus subtracted from the loss (verl's actor.entropy_coeff); the entropy
    comes from the fused log-prob kernel (no full-vocabulary log-probs). 0: not computed."""
    reference_reset_every: int = 0
    """Hard-reset the reference policy (PACS v2's anchor, algorithm.pacs.anchor=reference, and the KL term's)
    every this many RL steps, as ProRL (Liu et al. 2025) and PACS v2 do: after the update of step s with
    s - (last reset) = K, the live policy is copied into the reference and the optimizer's state (Adam's
    moments and step count) is re-initialised; the lr schedule keeps its position (actor/reference.py).
    0: never (the reference stays the policy RL started from). Needs a reference (the anchor or kl_loss_coef > 0)."""

    def __post_init__(self) -> None:
        try:
            get_loss(self.loss)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _positive("algorithm.ppo_epochs", self.ppo_epochs)
        _positive("algorithm.mini_batch_size", self.mini_batch_size, allow_zero=True)
        _positive("algorithm.micro_batch_size", self.micro_batch_size)
        _positive("algorithm.logprob_micro_batch_size", self.logprob_micro_batch_size, allow_zero=True)
        try:
            split_correction(self.rollout_correction)
            for key in ("icepop_bounds", "geo_bounds", "outlier_bounds"):
                check_ratio_bounds(f"algorithm.{key}", getattr(self, key))
        except ValueError as e:
            msg = str(e) if str(e).startswith("algorithm.") else f"algorithm.rollout_correction={e}"
            raise ConfigError(msg) from None
        _choice("algorithm.is_level", self.is_level, ("auto", "token", "sequence"))
        if not self.is_cap > 1:
            raise ConfigError(f"algorithm.is_cap={self.is_cap} must be > 1, e.g. 2.0")
        if self.traits.correction_unit == "row" and self.is_level == "token":
            raise ConfigError(
                f"algorithm.is_level=token with algorithm.loss={self.loss}: the loss weights whole rows (its loss is "
                "per sequence, e.g. PACS's BCE); use algorithm.is_level=sequence (or auto)"
            )
        _positive("algorithm.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, allow_zero=True)
        _positive("algorithm.reference_reset_every", self.reference_reset_every, allow_zero=True)
        if self.reference_reset_every and not self.needs_reference:
            raise ConfigError(
                f"algorithm.reference_reset_every={self.reference_reset_every} resets a reference policy this run does "
                "not have: set algorithm.pacs.anchor=reference (PACS v2) or algorithm.kl_loss_coef > 0, or "
                "algorithm.reference_reset_every=0"
            )
        check_algorithm_switches(self)

    @property
    def traits(self) -> LossTraits:
        """What the selected loss declared at its registration (pacs/registry.py)."""
        return get_loss(self.loss).traits

    @property
    def needs_reference(self) -> bool:
        """Whether a frozen reference policy is built (actor/reference.py): for the KL term or PACS v2's anchor."""
        return self.kl_loss_coef > 0 or self.traits.anchor(self.loss_config()) == "reference"

    def loss_config(self, name: str = "") -> PACSConfig | PolicyLossConfig | None:
        """The config section loss ``name`` (default: the selected one) reads (``LossTraits.section``), with
        ``adv_estimator=auto`` resolved by its traits; None for a loss that reads none."""
        traits = get_loss(name or self.loss).traits
        if traits.section is None:
            return None
        section = getattr(self, traits.section)
        if not isinstance(section, PolicyLossConfig):
            return section
        estimator = section.adv_estimator
        if estimator == "auto":
            estimator = traits.auto_estimator
        return replace(section, adv_estimator=estimator)

    def correction(self) -> RolloutCorrectionConfig:
        """``rollout_correction`` and its bounds, resolved for the selected loss (pacs/rollout_correction.py):
        PACS weighs rows, the other losses tokens."""
        weight, masks = split_correction(self.rollout_correction)
        return RolloutCorrectionConfig(
            weight=weight,
            masks=masks,
            cap=self.is_cap,
            level=self.resolved_is_level,
            unit=self.traits.correction_unit,
            icepop=_bounds(self.icepop_bounds),
            geo=_bounds(self.geo_bounds),
            outlier=_bounds(self.outlier_bounds),
        )

    @property
    def resolved_is_level(self) -> str:
        """``is_level`` with "auto" resolved: sequence for a loss that weighs rows (pacs), token for the others."""
        if self.is_level != "auto":
            return self.is_level
        return "sequence" if self.traits.correction_unit == "row" else "token"


def _bounds(pair: list[float]) -> tuple[float, float]:
    """A mask's [low, high] (validated as two numbers at construction) as the pair the algorithm takes."""
    low, high = pair
    return (float(low), float(high))


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
    overwrite: bool = False
    """With resume=never: move an old run found in output_dir aside (to OUTPUT_DIR.old-<time>) instead of
    refusing to start; with a named older checkpoint: move the newer ones aside (run/run_dir.py)."""
    seed: int = 42
    """Seed of everything not seeded elsewhere."""
    export_hf: bool = False
    """Also write Hugging Face safetensors with each checkpoint."""
    sft_warmup_steps: int = 0
    """Supervised steps before RL (the synthetic task uses it to learn the answer *format* only); the maximum
    when ``sft_warmup_stop.until=valid_calls``."""
    sft_warmup_stop: WarmupStopConfig = field(default_factory=WarmupStopConfig)
    """When the warm-up stops: after sft_warmup_steps ("steps"), or once the tool warm-up's held-out calls parse
    and run ("valid_calls"; config/warmup.py)."""
    val_n: int = 4
    """Samples per validation problem."""
    val_k: list[int] = field(default_factory=lambda: [1])
    """k values of the reported pass@k (each <= val_n)."""
    val_temperature: float = 0.6
    """Validation sampling temperature (>= 0); 0 is greedy decoding (as verl's val_kwargs and the eval CLI),
    where the val_n samples of a problem are identical."""
    val_top_p: float = 0.95
    """Validation nucleus sampling, in (0, 1]; 1 disables it."""
    val_max_problems: int = 0
    """Cap on problems per validation set (0: all)."""
    val_sets: list[str] = field(default_factory=list)
    """Names of the validation sets to run (empty: all): the synthetic task's "arith_heldout" (or "arith")
    and "arith_val", or the names data.val_files resolve to. A validation costs its sets' samples."""
    log_rollouts: int = 4
    """Rollout samples saved per step to rollouts.jsonl."""
    dry_run: bool = False
    """Validate the config and layout, print them, and exit before any heavy work."""
    stop_after_s: float = 0.0
    """Time budget of one launch in seconds, counted from the launch (the rank process's start, so model
    loading and the warm-up count): checkpoint and exit 143 (requeue) before it runs out, leaving room
    for the longest step seen plus stop_margin_s; 0: no budget."""
    deadline_unix: float = 0.0
    """Absolute end (Unix seconds) by which the run must have checkpointed and exited 143, e.g. the
    Slurm job's end time (examples/slurm/multinode.sbatch sets it); 0: none."""
    stop_margin_s: float = 60.0
    """Seconds kept free before stop_after_s / deadline_unix beyond the longest step (a checkpoint
    save must fit in them until a periodic save has been timed)."""
    val_before_train: bool = False
    """Validate once before the first RL step of a fresh run (after the format warm-up), logged as step 0
    (as verl's trainer.val_before_train); needs test_freq > 0, which builds the validation sets."""
    keep_checkpoints: int = 2
    """Valid checkpoints kept (older ones are deleted; damaged ones are moved aside, never counted); 0 keeps all."""

    def __post_init__(self) -> None:
        _positive("trainer.keep_checkpoints", self.keep_checkpoints, allow_zero=True)
        _positive("trainer.total_steps", self.total_steps, allow_zero=True)
        _positive("trainer.train_batch_size", self.train_batch_size)
        _positive("trainer.save_freq", self.save_freq, allow_zero=True)
        _positive("trainer.test_freq", self.test_freq, allow_zero=True)
        _positive("trainer.val_n", self.val_n)
        _positive("trainer.val_temperature", self.val_temperature, allow_zero=True)
        if not 0 < self.val_top_p <= 1:
            raise ConfigError(f"trainer.val_top_p={self.val_top_p} must be in (0, 1], e.g. 0.95 (1 disables it)")
        for key in ("stop_after_s", "deadline_unix", "stop_margin_s"):
            _positive(f"trainer.{key}", getattr(self, key), allow_zero=True)
        if self.val_before_train and not self.test_freq:
            raise ConfigError(
                "trainer.val_before_train=true needs validation: set trainer.test_freq > 0 (e.g. trainer.test_freq=50)"
            )
        for k in self.val_k:
            if not 1 <= k <= self.val_n:
                raise ConfigError(f"trainer.val_k has {k}: each k must be in 1..trainer.val_n={self.val_n}")

    def validates_at(self, step: int) -> bool:
        """Whether the loop validates after ``step``: every ``test_freq`` steps, and at the last step, so a run
        whose ``total_steps`` is not a multiple of ``test_freq`` (e.g. a resume with more steps) still ends
        with its final model's numbers.

        Example:
            >>> [s for s in range(1, 8) if TrainerConfig(total_steps=7, test_freq=3).validates_at(s)]
            [3, 6, 7]
            >>> TrainerConfig(total_steps=7, test_freq=0).validates_at(7)
            False
        """
        return bool(self.test_freq) and (step % self.test_freq == 0 or step == self.total_steps)


def stop_deadline(trainer: TrainerConfig, launched_unix: float) -> float:
    """The launch's absolute end (Unix seconds; 0: none): the earlier of ``deadline_unix`` and
    ``launched_unix + stop_after_s``.

    Example:
        >>> stop_deadline(TrainerConfig(stop_after_s=60, deadline_unix=2000.0), launched_unix=1000.0)
        1060.0
    """
    budget_end = launched_unix + trainer.stop_after_s if trainer.stop_after_s else 0.0
    ends = [e for e in (trainer.deadline_unix, budget_end) if e]
    return float(min(ends)) if ends else 0.0


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
    post_update_metrics: bool = True
    """PACS: after the step's update, one no-grad log-prob pass over the same batch logs the
    classifier's new state (pacs/post_loss, post_psi_*, post_classifier_acc); with one update per
    step the in-update pacs/* values are constant by construction."""

    def __post_init__(self) -> None:
        _choice("logging.level", self.level.upper(), ("DEBUG", "INFO", "WARNING", "ERROR"))
