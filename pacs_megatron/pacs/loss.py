"""The PACS loss: RLVR as supervised classification of each response's outcome.

Per group of n responses to one prompt (rows contiguous), with R_i in {0, 1} the verifiable reward:

    r_i   = implicit_reward(logp_i, anchor_logp_i)         [B]  (see implicit.py)
    psi_i = group_advantage(r)_i                           [B]  (rloo by default, see advantage.py)
    loss  = 1/B * sum_i w_i * BCEWithLogits(psi_i, R_i)          (torch's BCEWithLogitsLoss(weight=w))

so the actor (the policy's log-probs) and the critic (psi, a function of the same log-probs) are trained by one
supervised signal. Because psi_i depends on every response of its group, a group must sit whole in one loss
computation; a row of loss weight 0 leaves its group's baseline and class weights (advantage.py). The anchor
(pi_old in v1, a reference policy reset every K steps in v2) and the rows that leave: docs/pacs_v2.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pacs_megatron.batch.rows import check_groups
from pacs_megatron.pacs.advantage import drop_lone_rows, group_advantage
from pacs_megatron.pacs.config import PACSConfig
from pacs_megatron.pacs.implicit import implicit_reward
from pacs_megatron.pacs.rollout_correction import kept_rows


def _require_binary(scores: torch.Tensor, what: str) -> None:
    if not bool(((scores == 0) | (scores == 1)).all()):
        raise ValueError(f"weight_mode={what!r} needs 0/1 verifiable rewards; got values {scores.unique().tolist()}")


def class_weights(
    scores: torch.Tensor, group_size: int, mode: str | None, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row BCE weights ``[B]`` (float32) for ``scores [B]``; with ``keep`` (``[B]`` bool) "question"
    counts a group's kept rows only (a dropped row's own weight is left to its caller's 0).

    ``mode="question"``: within each group that has both outcomes, sklearn's "balanced" class weights
    n / (2 * count(class)); a group with one outcome keeps weight 1. ``"only_positive"`` / ``"only_negative"``:
    1 on that class, 0 on the other; None: all 1.

    Example:
        >>> class_weights(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "question").tolist()
        [2.0, 0.6666666865348816, 0.6666666865348816, 0.6666666865348816]
        >>> class_weights(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "question", torch.tensor([1, 1, 0, 0]).bool()).tolist()
        [1.0, 1.0, 1.0, 1.0]
    """
    check_groups(scores.numel(), group_size)
    ones = torch.ones(scores.shape, dtype=torch.float32, device=scores.device)
    if mode is None:
        return ones
    _require_binary(scores, mode)
    pos = scores.float()
    if mode == "only_positive":
        return pos
    if mode == "only_negative":
        return 1.0 - pos
    if mode != "question":
        raise ValueError(f"weight_mode={mode!r}: choose None, 'question', 'only_positive' or 'only_negative'")
    grouped = pos.reshape(-1, group_size)
    n_pos = grouped.sum(dim=1, keepdim=True)
    n_neg = group_size - n_pos
    mixed = (n_pos > 0) & (n_neg > 0)
    # n_samples / (n_classes * count(class)); clamp only guards the unused branch of torch.where.
    w_pos = group_size / (2.0 * n_pos.clamp(min=1.0))
    w_neg = group_size / (2.0 * n_neg.clamp(min=1.0))
    w = torch.where(mixed, torch.where(grouped > 0.5, w_pos, w_neg), torch.ones_like(grouped))
    if keep is None or bool(keep.all()):
        return w.reshape(-1)
    # Groups with a dropped row: the same rule over their kept rows; the others unchanged, bit for bit.
    k = keep.reshape(-1, group_size).to(pos.dtype)
    n_pos_k = (grouped * k).sum(dim=1, keepdim=True)
    n_kept = k.sum(dim=1, keepdim=True)
    n_neg_k = n_kept - n_pos_k
    w_kept = torch.where(
        grouped > 0.5, n_kept / (2.0 * n_pos_k.clamp(min=1.0)), n_kept / (2.0 * n_neg_k.clamp(min=1.0))
    )
    w_kept = torch.where((n_pos_k > 0) & (n_neg_k > 0), w_kept, torch.ones_like(w_kept))
    return torch.where(n_kept < group_size, w_kept, w).reshape(-1)


def pacs_loss(
    logp: torch.Tensor,
    anchor_logp: torch.Tensor,
    response_mask: torch.Tensor,
    scores: torch.Tensor,
    group_size: int,
    config: PACSConfig,
    group_ids: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PACS loss over whole groups.

    Rollout correction (``is_weights``). The loss is an empirical mean over responses y_i that should be
    drawn from pi_old, the policy the update starts from; its gradient

        d loss / d theta = 1/B sum_i w_i (sigmoid(psi_i) - R_i) d psi_i / d theta

    estimates E_{y ~ pi_old}[w (sigmoid(psi) - R) d psi / d theta]. When the engine samples from
    pi_rollout != pi_old (FP8 weights, other kernels), E_{pi_old}[f(y)] = E_{pi_rollout}[rho(y) f(y)] with
    rho(y) = pi_old(y|x) / pi_rollout(y|x) = exp(sum_t (old_logp_t - rollout_logp_t)). A row's BCE term
    is a function of the whole response (not a sum over its tokens), so the ratio is the sequence's:
    the row's BCE weight becomes rho_i * w_i, with rho_i truncated at C (tis) or the row dropped outside
    [1/C, C] (mis) to bound the variance (biased, by at most the mass beyond C). A dropped row (weight 0)
    leaves its group (module docstring) and the mean's denominator: the loss is the mean over kept rows.
    The weights correct the sampling distribution only; the anchor of r is ``anchor_logp`` either way.

    Args:
        logp: ``[B, T]`` log-probs of the current policy (differentiable).
        anchor_logp: ``[B, T]`` log-probs r is measured against (no grad): pi_old's (``config.anchor="old"``)
            or the reference policy's (``"reference"``).
        response_mask: ``[B, T]`` 1 on response tokens.
        scores: ``[B]`` verifiable rewards R_i (0/1).
        group_size: n; rows ``[k*n, (k+1)*n)`` share a prompt.
        config: beta, reward_method, adv_estimator, norm_adv_by_std, weight_mode.
        group_ids: optional ``[B]`` prompt ids, checked for contiguity.
        is_weights: optional ``[B]`` or ``[B, 1]`` sequence-level importance weights (no gradient).

    Returns:
        ``(loss, metrics)``: the scalar loss (mean over the kept rows) and detached metrics under ``pacs/``
        (:func:`classifier_metrics`).
    """
    check_groups(logp.shape[0], group_size, group_ids)
    if scores.shape != (logp.shape[0],):
        raise ValueError(f"scores must be [B]={logp.shape[0]}, got {tuple(scores.shape)}")
    keep = None
    if is_weights is not None:
        if is_weights.numel() != logp.shape[0]:
            raise ValueError(f"PACS takes sequence-level is_weights [B]={logp.shape[0]}, got {tuple(is_weights.shape)}")
        keep, lone = drop_lone_rows(kept_rows(logp.shape[0], is_weights, logp.device), group_size)
    r = implicit_reward(logp, anchor_logp, response_mask, config.beta, config.reward_method)
    psi = group_advantage(r, group_size, config.adv_estimator, config.norm_adv_by_std, keep)
    target = scores.to(psi.dtype)
    weights = class_weights(scores, group_size, config.weight_mode, keep).to(psi.dtype)
    if is_weights is not None and keep is not None:  # (keep: a lone row's weight is 0 too)
        weights = weights * is_weights.reshape(-1).to(psi.dtype).detach() * keep.to(psi.dtype)
    kept = keep.sum().clamp(min=1).to(psi.dtype) if keep is not None else psi.new_tensor(float(len(psi)))
    loss = F.binary_cross_entropy_with_logits(psi, target, weight=weights, reduction="sum") / kept
    metrics = {"pacs/loss": loss.detach()} | classifier_metrics(psi, r, scores, group_size, keep)
    if keep is not None:
        metrics["pacs/lone_row_groups"] = psi.new_tensor(float(lone))
    return loss, metrics


@torch.no_grad()
def classifier_metrics(
    psi: torch.Tensor, r: torch.Tensor, scores: torch.Tensor, group_size: int, keep: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The classifier at work, over the kept rows: psi's mean, |mean| and std, the implicit reward's size,
    the mean predicted probability sigmoid(psi), the accuracy of psi > 0 against R, the Brier score
    mean (sigmoid(psi) - R)^2 (0.25 when psi = 0, lower when the classifier knows), and the share of
    mixed groups (a property of the rewards)."""
    rows = torch.ones_like(scores, dtype=torch.bool) if keep is None else keep
    p, y = psi.detach()[rows], scores.to(psi.dtype)[rows]
    prob = torch.sigmoid(p)
    grouped = scores.reshape(-1, group_size).float()
    mixed = ((grouped.max(dim=1).values > 0.5) & (grouped.min(dim=1).values < 0.5)).float()
    nan = psi.new_full((), float("nan"))
    return {
        "pacs/psi_mean": p.mean(),
        "pacs/psi_abs_mean": p.abs().mean(),
        "pacs/psi_std": p.std(unbiased=False) if p.numel() else nan,
        "pacs/implicit_reward_abs_mean": r.detach()[rows].abs().mean(),
        "pacs/prob_correct_mean": prob.mean(),
        "pacs/classifier_acc": ((p > 0).to(y.dtype) == y).float().mean(),
        "pacs/brier": (prob - y).square().mean(),
        "pacs/mixed_group_frac": mixed.mean(),
    }
