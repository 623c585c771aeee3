"""The algorithm math of PACS and its baselines, in pure torch (no distributed code).

Everything here runs on a laptop CPU and is unit-tested against hand-computed numbers.
"""

from pacs_megatron.pacs.advantage import check_groups, group_advantage
from pacs_megatron.pacs.config import PACSConfig, PolicyLossConfig
from pacs_megatron.pacs.gae import explained_variance, gae_advantages, outcome_token_rewards, value_loss
from pacs_megatron.pacs.group_filter import keep_groups, take_groups
from pacs_megatron.pacs.implicit_reward import implicit_reward
from pacs_megatron.pacs.loss import class_weights, pacs_loss
from pacs_megatron.pacs.overlong import overlong_penalty, truncation_weights
from pacs_megatron.pacs.policy_loss import aggregate, clipped_policy_loss, outcome_advantages
from pacs_megatron.pacs.registry import LOSSES, LossInputs, LossSpec, get_loss, register_loss
from pacs_megatron.pacs.regularizers import kl_estimate, regularize

__all__ = [
    "LOSSES",
    "LossInputs",
    "LossSpec",
    "PACSConfig",
    "PolicyLossConfig",
    "aggregate",
    "check_groups",
    "class_weights",
    "explained_variance",
    "gae_advantages",
    "clipped_policy_loss",
    "get_loss",
    "group_advantage",
    "implicit_reward",
    "keep_groups",
    "kl_estimate",
    "outcome_advantages",
    "outcome_token_rewards",
    "overlong_penalty",
    "pacs_loss",
    "register_loss",
    "regularize",
    "take_groups",
    "truncation_weights",
    "value_loss",
]
