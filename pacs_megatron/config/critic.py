"""The learned critic of the paper's PPO baseline (``algorithm.policy.adv_estimator=gae``).

The critic is a second Megatron GPTModel, same architecture and TP/PP/DP layout as the actor and
colocated with it, whose vocabulary head is replaced by a scalar value head. It has its own Adam
optimizer and LR schedule (``critic.optim``, the same keys as ``optimizer``). The PACS reference's
PPO (ritzz-ai/PACS scripts/baseline/ppo.sh with its configs/ppo_trainer.yaml) uses critic lr 1e-5,
``cliprange_value=0.5``, grad clip 1.0, weight decay 0.01, and aggregates the value loss with the
actor's ``loss_agg_mode`` (``critic.loss_agg_mode: ${actor_rollout_ref.actor.loss_agg_mode}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pacs_megatron.config.base import ConfigError, _choice, _positive
from pacs_megatron.config.training import AlgorithmConfig, OptimizerConfig
from pacs_megatron.pacs.config import LOSS_AGG_MODES

if TYPE_CHECKING:
    from pacs_megatron.config.run import RunConfig


@dataclass
class CriticConfig:
    """Learned value function; built only when the policy loss uses ``adv_estimator=gae``."""

    init: str = "actor"
    """"actor": copy the policy's weights (again after the format warm-up, so the critic starts from
    the policy RL starts from) and add a zero-initialised value head w . h + b (verl: nn.Linear(H, 1));
    or a Hugging Face model directory of the same architecture (its LM head is ignored)."""
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """The critic's own optimizer and schedule (the reference: lr 1e-5)."""
    cliprange_value: float = 0.5
    """Clip of the value update: V is kept within V_old +- cliprange_value in the loss (verl: 0.5)."""
    micro_batch_size: int = 0
    """Sequences per critic forward/backward per DP rank; 0 means algorithm.micro_batch_size."""
    ppo_epochs: int = 0
    """Passes of the critic over each step's rollouts; 0 means algorithm.ppo_epochs."""
    loss_agg_mode: str = "auto"
    """How the value loss is reduced: "auto" (the actor's ``algorithm.policy.loss_agg_mode`` and
    ``loss_agg_horizon``, as the reference) or one of the actor's modes (token-mean, ...)."""

    def __post_init__(self) -> None:
        if not self.init:
            raise ConfigError("critic.init is empty: use 'actor' or a Hugging Face model directory")
        if not self.cliprange_value > 0:
            raise ConfigError(f"critic.cliprange_value={self.cliprange_value} must be > 0 (verl's default: 0.5)")
        _positive("critic.micro_batch_size", self.micro_batch_size, allow_zero=True)
        _positive("critic.ppo_epochs", self.ppo_epochs, allow_zero=True)
        _choice("critic.loss_agg_mode", self.loss_agg_mode, ("auto", *LOSS_AGG_MODES))


def critic_enabled(cfg: RunConfig) -> bool:
    """Whether ``cfg`` (a RunConfig) trains a learned critic: a loss that takes one (``LossTraits.gae``) with
    ``adv_estimator=gae``."""
    algo = cfg.algorithm
    return algo.traits.gae and getattr(algo.loss_config(), "adv_estimator", "") == "gae"


def critic_loss_agg(critic: CriticConfig, algorithm: AlgorithmConfig, max_response_length: int) -> tuple[str, int]:
    """``(loss_agg_mode, horizon)`` of the value loss: ``critic.loss_agg_mode``, "auto" resolved to the actor's
    mode; the horizon is the actor's ``algorithm.policy.loss_agg_horizon``, 0 resolved to
    ``max_response_length`` (``rollout.``) as the actor's (actor/train_step.py step_loss_config)."""
    mode = critic.loss_agg_mode
    horizon = algorithm.policy.loss_agg_horizon or max_response_length
    return (algorithm.policy.loss_agg_mode if mode == "auto" else mode), horizon
