"""Typed run configuration: one dataclass per area, validated at construction.

Loaded from YAML with ``a.b.c=value`` overrides through OmegaConf structured configs::

    cfg = load_config("examples/configs/cpu_tiny.yaml", ["trainer.total_steps=5", "parallel.tp=1"])

Every field carries a docstring; ``__post_init__`` raises :class:`ConfigError` naming the field and
the fix. Checks that need the model (TP divides the heads, ...) run at start-up in ``parallel/``; checks
that need the device, an import or the file system are launch/checks/preflight.py's. config/ runs no such code.
"""

from pacs_megatron.config.actor import ActorConfig, LoRAConfig
from pacs_megatron.config.base import ConfigError
from pacs_megatron.config.critic import CriticConfig, critic_enabled, critic_loss_agg
from pacs_megatron.config.data import ArithTaskConfig, DataConfig, RewardConfig
from pacs_megatron.config.launcher import LauncherConfig
from pacs_megatron.config.model import ModelConfig, ParallelConfig, TinyModelConfig
from pacs_megatron.config.rollout import RolloutConfig, SyncConfig, VLLMConfig
from pacs_megatron.config.run import RunConfig, config_from_dict, load_config, to_yaml
from pacs_megatron.config.training import AlgorithmConfig, LoggingConfig, OptimizerConfig, TrainerConfig

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ArithTaskConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "LauncherConfig",
    "LoggingConfig",
    "LoRAConfig",
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
    "critic_enabled",
    "critic_loss_agg",
    "load_config",
    "to_yaml",
]
