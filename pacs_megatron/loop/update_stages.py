"""The named stages of one RL step's update: this DP rank's rows, their advantages and pi_old's log-probs,
``ppo_epochs`` x mini-batches of the loss, and PACS v2's reference reset.

Each data-parallel rank trains on its own contiguous share of whole prompt groups, as :class:`TrainRows`
(advantages added) and then :class:`TrainBatch` (pi_old's log-probs added; batch/rows.py). Every function
runs on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from pacs_megatron.batch.build import dp_shard, split_mini_batches
from pacs_megatron.batch.packing import dp_balanced_shard
from pacs_megatron.batch.rows import Rollouts, TrainBatch, TrainRows
from pacs_megatron.config import RunConfig
from pacs_megatron.data.routing import RoutedExperts, fetch_routed_experts
from pacs_megatron.loop.advantages import AdvantageFn, outcome_step_advantages
from pacs_megatron.loop.diagnostics import post_update_metrics
from pacs_megatron.pacs.decoupled import decoupled_old_logp
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

if TYPE_CHECKING:
    from pacs_megatron.actor.actor import MegatronActor


def forward_rows(cfg: RunConfig, dp_size: int) -> int:
    """Rows of this DP rank's first mini-batch when they take their old log-probs from their training
    forward (``algorithm.old_logp_from_forward``; pi_theta = pi_old there), else 0."""
    algo = cfg.algorithm
    if not algo.old_logp_from_forward or algo.rollout_correction != "none":
        return 0
    return cfg.mini_batch_prompts // dp_size * cfg.rollout.n


@dataclass(frozen=True)
class OldLogp:
    """pi_old's log-probs and entropy of this rank's rows ``[first:]``: the first ``first`` rows (the
    step's first mini-batch, :func:`forward_rows`) take theirs from their own training forward."""

    first: int
    logp: torch.Tensor
    entropy: torch.Tensor


def prepare_local_batch(
    cfg: RunConfig,
    actor: MegatronActor,
    batch: Rollouts,
    dp_rank: int,
    dp_size: int,
    advantages_of: AdvantageFn | None = None,
) -> tuple[TrainRows, OldLogp, dict]:
    """This DP rank's groups with their advantages (``advantages_of``, default
    :func:`outcome_step_advantages`) and reference log-probs, and pi_old's log-probs of every row but
    the first :func:`forward_rows` (those come from their training forward in :func:`update_actor`)."""
    if cfg.algorithm.dynamic_batching:  # groups spread by tokens, per mini-batch (batch/packing.py)
        local = dp_balanced_shard(batch, dp_rank, dp_size, cfg.mini_batch_prompts)
    else:
        local = dp_shard(batch, dp_rank, dp_size)
    if batch.routed_experts is not None:  # the routing records of this rank's rows, from their holders
        assert isinstance(batch.routed_experts, RoutedExperts) and isinstance(local.routed_experts, RoutedExperts)
        local = replace(local, routed_experts=fetch_routed_experts(batch.routed_experts, local.routed_experts))
    adv = (advantages_of or (lambda r: outcome_step_advantages(cfg, r)))(local)
    ref = None
    if actor.reference is not None:  # algorithm.needs_reference (actor/reference.py)
        ref_mbs = cfg.algorithm.logprob_micro_batch_size or cfg.algorithm.micro_batch_size
        ref = actor.compute_ref_logprobs(
            local, ref_mbs, cfg.rollout.temperature, cfg.mini_batch_prompts // dp_size, response_only=True
        )
    rows = TrainRows.of(local, advantages=adv.advantages, ref_logp=ref, old_values=adv.old_values, returns=adv.returns)
    first = forward_rows(cfg, dp_size)
    old = entropy = torch.zeros((0, rows.input_ids.shape[1]))  # every row's comes from its training forward
    if first < len(rows):  # mini-batches after the first: the no-grad pass under pi_old
        mbs = cfg.algorithm.logprob_micro_batch_size or cfg.algorithm.micro_batch_size
        out = actor.compute_logprobs(
            rows.rows(first, len(rows)),
            mbs,
            cfg.rollout.temperature,
            with_entropy=True,
            mini_batch_groups=cfg.mini_batch_prompts // dp_size,
            response_only=True,  # the training forward's LM-head rows (actor/logit_rows.py)
        )
        old, entropy = out.token_logp, out.entropy
    return rows, OldLogp(first, old, entropy), dict(adv.metrics or {})


def finish_old_logp(cfg: RunConfig, local: TrainBatch) -> tuple[TrainBatch, dict]:
    """Once every row has its old log-probs: the policy's entropy, the rollout mismatch and, with
    ``algorithm.rollout_correction``, the importance weights."""
    m = local.response_mask.float()
    metrics = {"actor/entropy": (local.old_entropy * m).sum() / m.sum().clamp(min=1.0)}
    local, correction = rollout_mismatch(cfg, local)
    return local, metrics | correction


def update_actor(cfg: RunConfig, actor: MegatronActor, rows: TrainRows, old: OldLogp, dp_size: int) -> dict:
    """``ppo_epochs`` passes over mini-batches of whole groups, one optimizer step each. When ``old.first``
    rows have no old log-probs yet, the first mini-batch of the first epoch trains from its own forward
    (pi_theta = pi_old there) and its log-probs complete the batch's."""
    per_rank_prompts = cfg.mini_batch_prompts // dp_size
    history: list[dict] = []
    skipped_before = actor.skipped_steps
    old_logp, old_entropy = old.logp, old.entropy
    if old.first:
        metrics, fwd = actor.train_step_from_forward(rows.rows(0, old.first))
        history.append(metrics)
        old_logp, old_entropy = torch.cat([fwd.token_logp, old_logp]), torch.cat([fwd.entropy, old_entropy])
    local, extra = finish_old_logp(cfg, TrainBatch.of_rows(rows, old_logp=old_logp, old_entropy=old_entropy))
    for epoch in range(cfg.algorithm.ppo_epochs):
        for i, mini in enumerate(split_mini_batches(local, per_rank_prompts)):
            if epoch == 0 and i == 0 and old.first:
                continue  # trained above, from its own forward
            history.append(actor.train_step(mini))
    metrics = {k: sum(h[k] for h in history) / len(history) for k in history[0] if k != "actor/max_abs_logratio"}
    # Before any update the policy equals the rollout policy: any non-zero log-ratio here is noise
    # between the old-log-prob pass and the training forward, i.e. noise in PACS's reward.
    metrics["pacs/first_minibatch_max_logratio"] = history[0].get("actor/max_abs_logratio", float("nan"))
    metrics["actor/skipped_steps"] = history[-1].get("actor/skipped_steps", 0.0)
    metrics["actor/updates"] = float(len(history) - (actor.skipped_steps - skipped_before))  # applied, not skipped
    metrics |= post_update_metrics(cfg, actor, local)  # pacs/post_*: the classifier after the update
    return metrics | extra


def reset_reference(cfg: RunConfig, actor: MegatronActor, step: int) -> dict:
    """``algorithm.reference_reset_every`` = K: after the update of step s, once K steps have passed since the
    last reset (or the start of RL), the live policy becomes the reference and the optimizer starts afresh
    (:meth:`MegatronActor.reset_reference`). Logged wherever a reference exists (K = 0: never reset) as
    ``reference/reset`` (1 at a reset) and ``reference/age``: the age of the reference this step's update was
    measured against, in updated steps (0 when it is pi_old, as right after a reset), so it sits in one row with
    the step's ``pacs/*``. The last reset's step is checkpointed (Components.save): a resume keeps the schedule."""
    every, ref = cfg.algorithm.reference_reset_every, actor.reference
    if ref is None:
        return {}
    age = step - 1 - ref.reset_step  # the reference was the live policy after step reset_step: pi_old at +1
    reset = bool(every) and step - ref.reset_step >= every
    if reset:
        actor.reset_reference()
        ref.reset_step = step
        logger.info("step %d: reference policy reset to the live policy, optimizer state re-initialised", step)
    return {"reference/reset": float(reset), "reference/age": float(age)}


def rollout_mismatch(cfg: RunConfig, local: TrainBatch) -> tuple[TrainBatch, dict]:
    """The engine's sampled-token log-probs vs the actor's old log-probs (this rank's rows): mismatch
    metrics every step, and the weights of ``algorithm.rollout_correction`` (tis / mis and the masks of the
    menu, :meth:`AlgorithmConfig.correction`). The old log-probs are the proximal policy's (the actor
    before this step's update): the engine's only enter the weights, whatever policy version sampled them
    (pacs/decoupled.py)."""
    _, w, metrics = decoupled_old_logp(
        local.old_logp, local.rollout_logp, local.response_mask, cfg.algorithm.correction()
    )
    if w is None:  # no correction: is_weights (if any) are the truncation weights, unchanged
        return local, metrics
    if local.is_weights is not None:  # truncated rows already weighted 0 (algorithm.overlong.mask_truncated)
        w = w * local.is_weights
    return replace(local, is_weights=w), metrics
