"""KL to a frozen reference policy and an entropy bonus, added to any registered loss (pure torch).

For a registered loss L (PACS, GRPO, PPO) with its unit (registry.py), on ``[B, T]`` log-probs, reference
log-probs, entropy and response mask (batch/build.py's token layout)::

    L + kl_loss_coef * agg(kl_t) - entropy_coeff * agg(H_t)

``kl_t`` is one of Schulman's estimators (:func:`kl_estimate`); ``agg`` is L's own aggregation over the tokens it
keeps (:func:`_aggregate`), so the sum stays a mean over one unit and the train step's micro-batch weighting
(``LossSpec.denominator``) stays exact. Neither term is weighted by importance ratios (as verl: those multiply
the policy surrogate only). With both coefficients 0 :func:`regularize` returns the loss unchanged, the same
object. The reference and what it costs: docs/baselines.md, "Recipe switches".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pacs_megatron.batch.rows import TrainBatch
from pacs_megatron.pacs.advantage import drop_lone_rows
from pacs_megatron.pacs.config import KL_TYPES
from pacs_megatron.pacs.policy_loss import aggregate
from pacs_megatron.pacs.registry import LossSpec
from pacs_megatron.pacs.rollout_correction import kept_mask, kept_rows


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens' log-probs; with d_t = logp_t - ref_logp_t
    (Schulman, "Approximating KL divergence", 2020; the names are verl's ``kl_penalty``)::

        k1  / "kl"           d                                  unbiased, can be negative
        "abs"                |d|
        k2  / "mse"          d^2 / 2                            its gradient is the true KL's on-policy
        k3  / "low_var_kl"   exp(-d) - (-d) - 1                 >= 0, low variance; -d clamped to [-20, 20],
                                                                the value to [-10, 10] (as verl)
        k1+ / k3+            k1 / k3's value with k2's gradient (straight through)

    Example:
        >>> lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
        >>> [round(x, 4) for x in kl_estimate(lp, ref, "k3").tolist()]
        [0.3679, 0.7183]
    """
    if kind not in KL_TYPES:
        raise ValueError(f"kl_loss_type={kind!r}: choose one of {list(KL_TYPES)}")
    base = kind.rstrip("+")
    d = logp - ref_logp
    if base in ("k1", "kl"):
        value = d
    elif base == "abs":
        value = d.abs()
    elif base in ("k2", "mse"):
        value = 0.5 * d.square()
    else:
        neg = (-d).clamp(-20.0, 20.0)
        value = (torch.exp(neg) - neg - 1.0).clamp(-10.0, 10.0)
    if kind.endswith("+"):
        k2 = 0.5 * d.square()
        value = k2 - k2.detach() + value.detach()
    return value


def _aggregate(values: torch.Tensor, x: TrainBatch, spec: LossSpec, cfg: Any) -> torch.Tensor:
    """``values [B, T]`` reduced as ``spec``'s loss reduces its own per-token terms, over the tokens it keeps
    (masked-IS and truncation rejections excluded, rollout_correction.kept_mask)::

        unit "token"   token-mean over the micro-batch
        unit "agg"     the config's loss_agg_mode (GRPO / PPO; verl aggregates its kl and entropy terms
                       with the actor's loss_agg_mode too)
        unit "row"     per-row token mean, averaged over the loss's rows
        unit "group"   the same over the rows a group baseline keeps (PACS, whose BCE is per row: a row left
                       alone in its group leaves, pacs/advantage.py)
    """
    mask = kept_mask(x.response_mask, x.is_weights)
    values = values.masked_fill(~mask, 0.0)  # padding may hold anything; 0 * inf would not be 0
    if spec.unit == "agg":
        return aggregate(values, mask, cfg.loss_agg_mode, cfg.loss_agg_horizon)
    m = mask.to(values.dtype)
    if spec.unit == "token":
        return values.sum() / m.sum().clamp(min=1.0)
    row_means = values.sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)
    if spec.unit == "group":  # the loss's rows only: a row left alone in its group left the loss
        keep, _ = drop_lone_rows(kept_rows(len(x), x.is_weights, values.device), x.group_size)
        row_means = row_means * keep.to(values.dtype)
    return row_means.sum() / spec.denominator(x, cfg).to(values.dtype).clamp(min=1.0)


def regularize(spec: LossSpec, kl_coef: float, kl_type: str, entropy_coeff: float) -> LossSpec:
    """``spec`` with the KL and entropy terms added (module docstring); ``spec`` itself when both are 0.

    The returned loss needs ``TrainBatch.ref_logp`` when ``kl_coef`` > 0 and the policy's entropy when
    ``entropy_coeff`` > 0 (``needs_entropy`` tells the train step); it reports ``actor/kl_loss`` and
    ``actor/entropy_loss``, the aggregated terms before their coefficients.
    """
    if not kl_coef and not entropy_coeff:
        return spec
    if kl_coef:
        kl_estimate(torch.zeros(1), torch.zeros(1), kl_type)  # an unknown estimator fails here, not mid-step

    def fn(
        x: TrainBatch, logp: torch.Tensor, cfg: Any, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = spec.fn(x, logp, cfg, entropy)
        metrics = dict(metrics)
        if kl_coef:
            if x.ref_logp is None:
                raise ValueError("algorithm.kl_loss_coef > 0 needs TrainBatch.ref_logp (the reference log-probs)")
            kl = _aggregate(kl_estimate(logp, x.ref_logp.to(logp.dtype), kl_type), x, spec, cfg)
            loss = loss + kl_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        if entropy_coeff:
            if entropy is None:
                raise ValueError("algorithm.entropy_coeff > 0 needs the policy's entropy (with_entropy in the forward)")
            term = _aggregate(entropy, x, spec, cfg)
            loss = loss - entropy_coeff * term
            metrics["actor/entropy_loss"] = term.detach()
        return loss, metrics

    return replace(spec, fn=fn, needs_entropy=spec.needs_entropy or bool(entropy_coeff))
