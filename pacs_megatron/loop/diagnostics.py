"""PACS diagnostics after the update: the classifier's state on the batch it was just trained on.

PACS's implicit reward is ``r_i = beta * sum_t(logp - logp_old)``. Measured *during* the only update
of a step (the default recipe: one mini-batch, one epoch), ``logp == logp_old``, so ``pacs/loss``,
``pacs/psi_*`` and ``pacs/implicit_reward_*`` are the constants ln 2, 0 and 0 by construction, and
``pacs/classifier_acc`` is just 1 - reward. What a user wants to see is whether the update moved the
classifier the right way: so after the step's updates this stage runs one no-grad log-prob pass of
the actor over the same local batch and evaluates the same loss against the rollout log-probs:

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

from pacs_megatron.pacs.advantage import group_advantage
from pacs_megatron.pacs.implicit import implicit_reward
from pacs_megatron.pacs.loss import pacs_loss
from pacs_megatron.pacs.registry import pacs_anchor
from pacs_megatron.pacs.rollout_correction import kept_rows

if TYPE_CHECKING:
    from pacs_megatron.actor.actor import MegatronActor
    from pacs_megatron.config import RunConfig
    from pacs_megatron.pacs.batch import TrainBatch

POST_PREFIX = "pacs/post_"
POST_SKIP = ("pacs/mixed_group_frac", "pacs/lone_row_groups")
"""Not recomputed after the update: properties of the rewards and the row weights, not of the classifier."""
QUANTILES = (0.1, 0.5, 0.9)


def post_update_metrics(cfg: RunConfig, actor: MegatronActor, local: TrainBatch) -> dict[str, float]:
    """``pacs/post_*`` for this step (empty unless the loss is PACS and the switch is on); collective."""
    if cfg.algorithm.loss != "pacs" or not cfg.logging.post_update_metrics:
        return {}
    mbs = cfg.algorithm.logprob_micro_batch_size or cfg.algorithm.micro_batch_size
    with torch.no_grad():
        out = actor.compute_logprobs(
            local, micro_batch_size=mbs, temperature=cfg.rollout.temperature, response_only=True
        )
        pacs = cfg.algorithm.pacs
        logp = out.token_logp.float()
        anchor = pacs_anchor(local, logp, pacs).float()  # the loss's own choice of anchor
        w = local.is_weights  # the loss's row weights: a dropped row (weight 0) is out of every metric, as of the loss
        _, m = pacs_loss(logp, anchor, local.response_mask, local.scores, local.group_size, pacs, is_weights=w)
        keep = kept_rows(len(logp), w, logp.device) if w is not None else None
        r = implicit_reward(logp, anchor, local.response_mask, pacs.beta, pacs.reward_method)
        psi = group_advantage(r, local.group_size, pacs.adv_estimator, pacs.norm_adv_by_std, keep)
        psi = psi if keep is None else psi[keep]
        for q, v in zip(QUANTILES, torch.quantile(psi.double(), torch.tensor(QUANTILES, dtype=torch.float64))):
            m[f"pacs/psi_p{round(q * 100)}"] = v
    keys = [k for k in m if k not in POST_SKIP]
    groups = actor.groups
    values = torch.stack([m[k].detach().float() for k in keys]).to(groups.device)  # nccl reduces device tensors
    if groups.dp_size > 1:  # every DP rank holds as many rows: the plain mean is the batch mean
        dist.all_reduce(values, group=groups.dp_group)
        values /= groups.dp_size
    return {POST_PREFIX + k.removeprefix("pacs/"): float(v) for k, v in zip(keys, values.tolist())}
