"""The algorithm math of PACS and its baselines, in pure torch (no distributed code).

Everything here runs on a laptop CPU and is unit-tested against hand-computed numbers.

The names below load their module on first use (PEP 562): ``pacs_megatron.pacs.config``, which the config
layer and the CLI's ``--help`` read, then costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the checkers see the real names
    from pacs_megatron.pacs.advantage import group_advantage
    from pacs_megatron.pacs.config import PACSConfig, PolicyLossConfig
    from pacs_megatron.pacs.gae import explained_variance, gae_advantages, outcome_token_rewards, value_loss
    from pacs_megatron.pacs.group_filter import keep_groups, take_groups
    from pacs_megatron.pacs.implicit import implicit_reward
    from pacs_megatron.pacs.loss import class_weights, pacs_loss
    from pacs_megatron.pacs.overlong import overlong_penalty, truncation_weights
    from pacs_megatron.pacs.policy_loss import aggregate, clipped_policy_loss, outcome_advantages
    from pacs_megatron.pacs.registry import LOSSES, LossSpec, LossTraits, get_loss, register_loss
    from pacs_megatron.pacs.regularizers import kl_estimate, regularize

_HOME = {
    "LOSSES": "registry",
    "LossSpec": "registry",
    "LossTraits": "registry",
    "PACSConfig": "config",
    "PolicyLossConfig": "config",
    "aggregate": "policy_loss",
    "class_weights": "loss",
    "clipped_policy_loss": "policy_loss",
    "explained_variance": "gae",
    "gae_advantages": "gae",
    "get_loss": "registry",
    "group_advantage": "advantage",
    "implicit_reward": "implicit",
    "keep_groups": "group_filter",
    "kl_estimate": "regularizers",
    "outcome_advantages": "policy_loss",
    "outcome_token_rewards": "gae",
    "overlong_penalty": "overlong",
    "pacs_loss": "loss",
    "register_loss": "registry",
    "regularize": "regularizers",
    "take_groups": "group_filter",
    "truncation_weights": "overlong",
    "value_loss": "gae",
}


def __getattr__(name: str) -> object:
    """Import ``name``'s module when it is first asked for."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


__all__ = [
    "LOSSES",
    "LossSpec",
    "LossTraits",
    "PACSConfig",
    "PolicyLossConfig",
    "aggregate",
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
