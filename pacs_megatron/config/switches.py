"""The recipe switches users bring from verl / DAPO / OpenRLHF / TRL, every one off by default.

``AlgorithmConfig`` holds the flat switches (``filter_groups``, ``max_gen_batches``, ``kl_loss_coef``,
``entropy_coeff``, ...) under the names the issue and verl use; their checks live here, beside the
nested :class:`OverlongConfig`. With all of them off a run is bit for bit the run without them
(tests/config/test_switches.py, tests/test_sampling_stages.py). docs/baselines.md maps each to verl's
and DAPO's flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pacs_megatron.config.base import ConfigError, _choice, _positive
from pacs_megatron.pacs.config import FILTER_MODES, KL_TYPES
from pacs_megatron.pacs.registry import losses_where

if TYPE_CHECKING:
    from pacs_megatron.config.run import RunConfig
    from pacs_megatron.config.training import AlgorithmConfig

SHORT_BATCH = ("train", "fail")


@dataclass
class OverlongConfig:
    """``algorithm.overlong.*``: DAPO's overlong reward shaping and truncated-response masking."""

    buffer_len: int = 0
    """DAPO's soft overlong punishment (L_cache, verl ``reward_model.overlong_buffer.len``): a response
    longer than rollout.max_response_length - buffer_len gets the reward penalty
    min(-(len - (max - buffer_len)) / buffer_len * penalty_factor, 0) (pacs/overlong.py). 0: off.
    GRPO / PPO only: PACS's labels are the 0/1 outcomes."""
    penalty_factor: float = 1.0
    """The penalty at the maximum length (verl ``reward_model.overlong_buffer.penalty_factor``)."""
    mask_truncated: bool = False
    """Drop responses cut at rollout.max_response_length from the loss (DAPO's overlong filtering): the
    row has weight 0 in the loss and its denominator; GRPO / PPO keep its reward in the group's outcome
    baseline (as verl), PACS takes it out of its group's psi baseline and class weights (pacs/loss.py)."""

    def __post_init__(self) -> None:
        _positive("algorithm.overlong.buffer_len", self.buffer_len, allow_zero=True)
        _positive("algorithm.overlong.penalty_factor", self.penalty_factor, allow_zero=True)


def check_algorithm_switches(algo: AlgorithmConfig) -> None:
    """The switches' own checks (called by ``AlgorithmConfig.__post_init__``)."""
    _choice("algorithm.filter_groups", algo.filter_groups, FILTER_MODES)
    if algo.max_gen_batches < 1:
        raise ConfigError(
            f"algorithm.max_gen_batches={algo.max_gen_batches} must be >= 1 (generation rounds per step; "
            "verl's max_num_gen_batches=0 means unlimited, which loops forever on solved data: give a bound, e.g. 10)"
        )
    _positive("algorithm.gen_batch_size", algo.gen_batch_size, allow_zero=True)
    _choice("algorithm.short_batch", algo.short_batch, SHORT_BATCH)
    _positive("algorithm.kl_loss_coef", algo.kl_loss_coef, allow_zero=True)
    _choice("algorithm.kl_loss_type", algo.kl_loss_type, KL_TYPES)
    _positive("algorithm.entropy_coeff", algo.entropy_coeff, allow_zero=True)


def check_run_switches(cfg: RunConfig) -> None:
    """Cross-area checks of the switches (called by ``RunConfig.__post_init__``)."""
    over, max_len = cfg.algorithm.overlong, cfg.rollout.max_response_length
    if over.buffer_len and not cfg.algorithm.traits.shaped_rewards:
        raise ConfigError(
            f"algorithm.overlong.buffer_len={over.buffer_len} with algorithm.loss={cfg.algorithm.loss}: the loss "
            "trains a classifier of the 0/1 outcome (PACS), a length-shaped reward is no label; use "
            "algorithm.overlong.mask_truncated=true for it, or algorithm.loss="
            f"{losses_where(lambda t: t.shaped_rewards)}"
        )
    if cfg.algorithm.filter_groups != "none" and cfg.rollout.placement == "separate":
        raise ConfigError(
            f"algorithm.filter_groups={cfg.algorithm.filter_groups} with rollout.placement=separate: the asynchronous "
            "loop samples fixed batches of trainer.train_batch_size prompts up to rollout.max_staleness steps ahead, "
            "so it cannot draw more generation rounds for a step; set algorithm.filter_groups=none, or "
            "rollout.placement=colocated with rollout.max_staleness=0"
        )
    if over.buffer_len > max_len:
        raise ConfigError(
            f"algorithm.overlong.buffer_len={over.buffer_len} exceeds rollout.max_response_length={max_len}: the "
            f"buffer is the last part of the allowed length (DAPO: 4096 of 20480); use at most {max_len}"
        )
