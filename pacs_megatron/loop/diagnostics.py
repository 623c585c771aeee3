"""PACS diagnostics after the update: the classifier's state on the batch it was just trained on.

PACS's implicit reward is ``r_i = beta * sum_t(logp - logp_old)``. Measured *during* the only update
of a step (the default recipe: one mini-batch, one epoch), ``logp == logp_old``, so ``pacs/loss``,
``pacs/psi_*`` and ``pacs/implicit_reward_*`` are the constants ln 2, 0 and 0 by construction, and
``pacs/classifier_acc`` is just 1 - reward. What a user wants to see is whether the update moved the
classifier the right way: so after the step's updates this stage runs one no-grad log-prob pass of
the actor over the same local batch and evaluates the same loss against the rollout log-probs (the loss's
``post_update`` trait, pacs/registry.py):

    pacs/post_loss, pacs/post_psi_mean, pacs/post_psi_abs_mean, pacs/post_psi_std,
    pacs/post_implicit_reward_abs_mean, pacs/post_prob_correct_mean, pacs/post_classifier_acc,
    pacs/post_brier, pacs/post_psi_p10, pacs/post_psi_p50, pacs/post_psi_p90

(means over data-parallel ranks; the quantiles are each rank's over its rows, then averaged). With
``algorithm.pacs.anchor=reference`` (PACS v2) r is measured against the reference, as the loss does, so the
in-update values are non-zero from the second step on and ``post_*`` show the classifier after the update.
With several mini-batches or epochs the in-update ``pacs/*`` mean something too; ``post_*`` is then the
state after all of them. Switch: ``logging.post_update_metrics``; cost: one forward of the batch without
grad (the old-log-prob pass's price).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from pacs_megatron.actor.actor import MegatronActor
    from pacs_megatron.batch.rows import TrainBatch
    from pacs_megatron.config import RunConfig


def post_update_metrics(cfg: RunConfig, actor: MegatronActor, local: TrainBatch) -> dict[str, float]:
    """The loss's post-update metrics for this step (``LossTraits.post_update``; empty for a loss without them or
    with the switch off), means over data-parallel ranks; collective."""
    hook = cfg.algorithm.traits.post_update
    if hook is None or not cfg.logging.post_update_metrics:
        return {}
    mbs = cfg.algorithm.logprob_micro_batch_size or cfg.algorithm.micro_batch_size
    with torch.no_grad():
        out = actor.compute_logprobs(
            local, micro_batch_size=mbs, temperature=cfg.rollout.temperature, response_only=True
        )
        m = hook(local, out.token_logp.float(), cfg.algorithm.loss_config())
    keys = list(m)
    groups = actor.groups
    values = torch.stack([m[k].detach().float() for k in keys]).to(groups.device)  # nccl reduces device tensors
    if groups.dp_size > 1:  # every DP rank holds as many rows: the plain mean is the batch mean
        dist.all_reduce(values, group=groups.dp_group)
        values /= groups.dp_size
    return dict(zip(keys, values.tolist()))
