"""The whole run's config, cross-area checks, and loading from YAML + overrides."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pacs_megatron.config.actor import ActorConfig
from pacs_megatron.config.base import ConfigError
from pacs_megatron.config.critic import CriticConfig
from pacs_megatron.config.data import DataConfig, RewardConfig
from pacs_megatron.config.launcher import LauncherConfig
from pacs_megatron.config.model import ModelConfig, ParallelConfig
from pacs_megatron.config.rollout import RolloutConfig, SyncConfig
from pacs_megatron.config.switches import check_run_switches
from pacs_megatron.config.training import AlgorithmConfig, LoggingConfig, OptimizerConfig, TrainerConfig


@dataclass
class RunConfig:
    """Everything one run needs. Cross-area checks live here; those that need the device or an import
    (quantized rollouts, routing replay) are launch/device_checks.py's, run by the preflight."""

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
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The learned critic (used when algorithm.policy.adv_estimator=gae)."""

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
        if algo.dynamic_batching and algo.max_tokens_per_micro_batch:
            longest = -(-(self.data.max_prompt_length + self.rollout.max_response_length) // 8) * 8
            if n * longest > algo.max_tokens_per_micro_batch:
                raise ConfigError(
                    f"algorithm.max_tokens_per_micro_batch={algo.max_tokens_per_micro_batch} is below one prompt "
                    f"group at full length: {n} x {longest} (data.max_prompt_length + rollout.max_response_length, "
                    f"rounded to 8) = {n * longest} tokens; raise the budget to at least {n * longest}"
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
        if algo.loss == "pacs" and algo.policy.adv_estimator == "gae":
            raise ConfigError("algorithm.policy.adv_estimator=gae is for loss ppo/grpo: set algorithm.loss=ppo")
        check_run_switches(self)  # dynamic sampling, overlong shaping, KL / entropy (config/switches.py)
        if self.critic.micro_batch_size % n:
            raise ConfigError(f"critic.micro_batch_size={self.critic.micro_batch_size}: use a multiple of {n}")
        if self.data.task == "arith" and self.reward.fn == "math":
            raise ConfigError("data.task=arith is scored by reward.fn=arith (exact match), not 'math'")
        estimator = algo.loss_config().adv_estimator
        if n < 2 and estimator in ("rloo", "grpo"):
            key = "algorithm.pacs.adv_estimator" if algo.loss == "pacs" else "algorithm.policy.adv_estimator"
            raise ConfigError(
                f"rollout.n={n} with {key}={estimator} (algorithm.loss={algo.loss}): the estimator compares the "
                "responses of a prompt group, so use rollout.n >= 2 (the paper: 8)"
            )

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
    try:
        layer = OmegaConf.load(path)
    except yaml.YAMLError as e:  # one line naming the place, not the parser's traceback
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {where}: YAML syntax error: {problem}") from None
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
