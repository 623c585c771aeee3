"""``seq-mean-token-sum-norm`` without a horizon (``policy.loss_agg_horizon=0``) divides by
``rollout.max_response_length``, verl's fixed response length, whatever the step's padded width
(issue #40 R6): the actor's train step and the critic's value loss both resolve it.

No ranks are started: the actor is built without ``__init__`` and its ``_update`` records the loss
config the step hands to megatron's loss function, which is all this checks.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from _actor_helpers import run_config, sample_batch

from pacs_megatron.actor.actor import MegatronActor
from pacs_megatron.batch.rows import as_train_batch
from pacs_megatron.config import AlgorithmConfig, RunConfig, critic_loss_agg
from pacs_megatron.loop.build import actor_sections
from pacs_megatron.pacs import PolicyLossConfig

VOCAB = 255


def _step_horizon(cfg: RunConfig, groups: int) -> int:
    """The ``loss_agg_horizon`` a GRPO train step on a batch of ``groups`` prompt groups hands to its
    loss function."""
    actor = object.__new__(MegatronActor)
    actor.sections, actor.spec, actor.groups, actor.moe_aux = actor_sections(cfg), None, None, None
    actor.response_logits = False
    seen = []
    actor._update = lambda micro, make, store, response_only: seen.append(make.keywords["loss_cfg"]) or {}
    batch = sample_batch(VOCAB, groups=groups)
    actor.train_step(as_train_batch(batch, torch.zeros(batch.input_ids.shape)), loss_name="grpo")
    return seen[0].loss_agg_horizon


def test_default_horizon_is_the_max_response_length():
    base = run_config("unused")
    policy = replace(base.algorithm.policy, loss_agg_mode="seq-mean-token-sum-norm", loss_agg_horizon=0)
    cfg = replace(base, algorithm=replace(base.algorithm, policy=policy))
    narrow, wide = sample_batch(VOCAB, groups=1).input_ids.shape[1], sample_batch(VOCAB).input_ids.shape[1]
    assert narrow != wide  # two steps of different padded widths ...
    assert _step_horizon(cfg, 1) == _step_horizon(cfg, 4) == cfg.rollout.max_response_length  # ... one horizon
    fixed = replace(cfg, algorithm=replace(cfg.algorithm, policy=replace(policy, loss_agg_horizon=4096)))
    assert _step_horizon(fixed, 4) == 4096  # an explicit horizon is kept

    gae = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm", adv_estimator="gae")
    critic_cfg = RunConfig(algorithm=AlgorithmConfig(loss="ppo", policy=gae))
    horizon = critic_cfg.rollout.max_response_length
    assert critic_loss_agg(critic_cfg.critic, critic_cfg.algorithm, horizon) == ("seq-mean-token-sum-norm", horizon)
