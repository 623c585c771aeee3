"""One registry for the trainable losses, so the trainer selects PACS or a baseline by name.

A loss takes a :class:`LossInputs` (one micro-batch of whole groups) and its own sub-config
(``AlgorithmConfig.loss_config()``: PACSConfig for pacs, PolicyLossConfig for grpo / ppo, GSPOConfig for
gspo) and returns ``(loss, metrics)``, where ``loss`` is a *mean* over the loss's unit (rows, or response
tokens for ``token-mean``). ``denominator`` reports that unit count, so a caller that splits a
mini-batch into micro-batches (and data-parallel ranks) weights each micro-batch by
``denominator / total`` and gets exactly the full mini-batch's loss.

Example:
    >>> import torch
    >>> from pacs_megatron.pacs.config import PACSConfig
    >>> x = LossInputs(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([1.0, 0.0]), 2)
    >>> loss, m = LOSSES["pacs"].fn(x, PACSConfig())
    >>> round(loss.item(), 4)  # psi = 0 for both rows: BCE(0, y) = log 2
    0.6931
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pacs_megatron.pacs.loss import pacs_loss
from pacs_megatron.pacs.policy_loss import clipped_policy_loss, gspo_policy_loss
from pacs_megatron.pacs.rollout_correction import kept_mask, kept_rows


@dataclass(frozen=True)
class LossInputs:
    """One loss computation's tensors: whole groups, rows of a group contiguous."""

    logp: torch.Tensor
    """``[B, T]`` current log-probs (differentiable)."""
    old_logp: torch.Tensor
    """``[B, T]`` log-probs of the rollout policy."""
    response_mask: torch.Tensor
    """``[B, T]`` 1 on response tokens."""
    scores: torch.Tensor
    """``[B]`` verifiable rewards."""
    group_size: int
    """n responses per prompt."""
    advantages: torch.Tensor | None = None
    """``[B]`` outcome advantages (baselines only; computed over whole groups before splitting)."""
    group_ids: torch.Tensor | None = None
    """``[B]`` prompt ids, checked for contiguity when given."""
    is_weights: torch.Tensor | None = None
    """Rollout-correction importance weights (pacs/rollout_correction.py): ``[B, T]`` per token or ``[B, 1]``
    per sequence; None: no correction."""
    ref_logp: torch.Tensor | None = None
    """``[B, T]`` log-probs of the frozen reference policy (``algorithm.kl_loss_coef`` > 0; pacs/regularizers.py)."""
    entropy: torch.Tensor | None = None
    """``[B, T]`` token entropy of the current policy, differentiable (``algorithm.entropy_coeff`` > 0)."""


LossFn = Callable[[LossInputs, Any], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: the function and whether it needs outcome advantages."""

    fn: LossFn
    needs_advantages: bool
    """Whether the trainer must compute outcome advantages for it before the update."""
    unit: str = "row"
    """What the returned mean averages over: "row", "token", or "agg" (the config's loss_agg_mode)."""
    needs_entropy: bool = False
    """Whether the loss reads ``LossInputs.entropy`` (the train step then asks the kernel for it)."""

    def denominator(self, inputs: LossInputs, config: Any) -> torch.Tensor:
        """How many units (response tokens or rows) this micro-batch's mean averages over; units that
        masked IS rejected (weight 0) are not counted, as the losses leave them out of their means."""
        mask = kept_mask(inputs.response_mask, inputs.is_weights)
        if self.unit == "token" or (self.unit == "agg" and getattr(config, "loss_agg_mode", None) == "token-mean"):
            return mask.sum().to(torch.float64)
        if self.unit == "agg":  # sequence-level aggregations average over rows that kept a token
            return mask.any(dim=-1).sum().to(torch.float64)
        return kept_rows(inputs.logp.shape[0], inputs.is_weights).sum().to(torch.float64)


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, needs_advantages: bool = False, unit: str = "row") -> Callable[[LossFn], LossFn]:
    """Decorator: make ``fn`` selectable as ``algorithm.loss=name`` (``unit``: see LossSpec)."""
    if unit not in ("row", "token", "agg"):
        raise ValueError(f"unit={unit!r}: choose row, token or agg")

    def deco(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = LossSpec(fn, needs_advantages, unit)
        return fn

    return deco


def get_loss(name: str) -> LossSpec:
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"algorithm.loss={name!r} is not registered: choose one of {sorted(LOSSES)}") from None


@register_loss("pacs")
def _pacs(x: LossInputs, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return pacs_loss(
        x.logp, pacs_anchor(x, cfg), x.response_mask, x.scores, x.group_size, cfg, x.group_ids, x.is_weights
    )


def pacs_anchor(x: LossInputs, cfg: Any) -> torch.Tensor:
    """The log-probs PACS's implicit reward is measured against (``PACSConfig.anchor``)."""
    if getattr(cfg, "anchor", "old") == "old":
        return x.old_logp
    if x.ref_logp is None:
        raise ValueError("algorithm.pacs.anchor=reference needs LossInputs.ref_logp (the reference policy's log-probs)")
    return x.ref_logp.to(x.logp.dtype)


def _clipped(x: LossInputs, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if x.advantages is None:
        raise ValueError("the clipped policy loss needs LossInputs.advantages (outcome advantages)")
    return clipped_policy_loss(x.logp, x.old_logp, x.response_mask, x.advantages, cfg, x.is_weights)


# GRPO and PPO-clip share the clipped surrogate; they differ in the advantage (AlgorithmConfig.
# loss_config resolves policy.adv_estimator=auto: grpo -> group-normalised, ppo -> leave-one-out,
# i.e. PPO-clip with a critic-free baseline; policy.adv_estimator=gae gives per-token GAE advantages
# from the learned critic, filled in by critic_stages before the update).
register_loss("grpo", needs_advantages=True, unit="agg")(_clipped)
register_loss("ppo", needs_advantages=True, unit="agg")(_clipped)


@register_loss("gspo", needs_advantages=True, unit="agg")
def _gspo(x: LossInputs, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (pacs/policy_loss.py::gspo_policy_loss) with outcome advantages (GSPOConfig: GRPO's by default)."""
    if x.advantages is None:
        raise ValueError("the gspo loss needs LossInputs.advantages (outcome advantages)")
    return gspo_policy_loss(x.logp, x.old_logp, x.response_mask, x.advantages, cfg, x.is_weights)


@register_loss("sft", unit="token")
def _sft(x: LossInputs, cfg: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised warm-up: token-mean negative log-likelihood of the response tokens (``cfg`` and
    ``old_logp`` unused). The CPU recipe uses it to teach the answer *format* before RL."""
    m = x.response_mask.to(x.logp.dtype)
    loss = -(x.logp * m).sum() / m.sum().clamp(min=1.0)
    return loss, {"sft/loss": loss.detach()}
