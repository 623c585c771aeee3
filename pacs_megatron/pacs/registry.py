"""One registry for the trainable losses, so the trainer selects PACS or a baseline by name.

A loss takes a :class:`~pacs_megatron.pacs.batch.TrainBatch` (one micro-batch of whole groups), the current
policy's differentiable log-probs ``logp [B, T]``, its own sub-config
(``AlgorithmConfig.loss_config()``: PACSConfig for pacs, PolicyLossConfig for grpo / ppo, GSPOConfig for
gspo) and the current policy's token entropy when it asks for it (``LossSpec.needs_entropy``), and returns
``(loss, metrics)``, where ``loss`` is a *mean* over the loss's unit (rows, or response
tokens for ``token-mean``). ``denominator`` reports that unit count, so a caller that splits a
mini-batch into micro-batches (and data-parallel ranks) weights each micro-batch by
``denominator / total`` and gets exactly the full mini-batch's loss.

Example:
    >>> import torch
    >>> from pacs_megatron.pacs.config import PACSConfig
    >>> from pacs_megatron.pacs.batch import loss_batch
    >>> b = loss_batch(torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([1.0, 0.0]), 2)
    >>> loss, m = LOSSES["pacs"].fn(b, torch.zeros(2, 3), PACSConfig())
    >>> round(loss.item(), 4)  # psi = 0 for both rows: BCE(0, y) = log 2
    0.6931
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pacs_megatron.pacs.advantage import drop_lone_rows
from pacs_megatron.pacs.batch import Rollouts, TrainBatch
from pacs_megatron.pacs.loss import pacs_loss
from pacs_megatron.pacs.policy_loss import clipped_policy_loss, gspo_policy_loss
from pacs_megatron.pacs.rollout_correction import kept_mask, kept_rows

LossFn = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
"""``fn(batch: TrainBatch, logp: Tensor, cfg, entropy: Tensor | None = None) -> (loss, metrics)``."""


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: the function and whether it needs outcome advantages."""

    fn: LossFn
    needs_advantages: bool
    """Whether the trainer must compute outcome advantages for it before the update."""
    unit: str = "row"
    """What the returned mean averages over: "row", "group" (rows, less those left alone in their group: a group
    baseline's loss, PACS), "token", or "agg" (the config's loss_agg_mode)."""
    needs_entropy: bool = False
    """Whether the loss reads the current policy's entropy (the train step then asks the kernel for it)."""

    def denominator(self, rows: Rollouts, config: Any) -> torch.Tensor:
        """How many units (response tokens or rows) this micro-batch's mean averages over; units that
        masked IS rejected (weight 0) are not counted, as the losses leave them out of their means. It
        reads the masks only, so it is known before the forward."""
        mask = kept_mask(rows.response_mask, rows.is_weights)
        if self.unit == "token" or (self.unit == "agg" and getattr(config, "loss_agg_mode", None) == "token-mean"):
            return mask.sum().to(torch.float64)
        if self.unit == "agg":  # sequence-level aggregations average over rows that kept a token
            return mask.any(dim=-1).sum().to(torch.float64)
        keep = kept_rows(len(rows), rows.is_weights)
        if self.unit == "group":  # a row alone in its group has no baseline and leaves too (pacs/advantage.py)
            keep, _ = drop_lone_rows(keep, rows.group_size)
        return keep.sum().to(torch.float64)


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, needs_advantages: bool = False, unit: str = "row") -> Callable[[LossFn], LossFn]:
    """Decorator: make ``fn`` selectable as ``algorithm.loss=name`` (``unit``: see LossSpec)."""
    if unit not in ("row", "group", "token", "agg"):
        raise ValueError(f"unit={unit!r}: choose row, group, token or agg")

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


Metrics = dict[str, torch.Tensor]


@register_loss("pacs", unit="group")
def _pacs(
    b: TrainBatch, logp: torch.Tensor, cfg: Any, entropy: torch.Tensor | None = None
) -> tuple[torch.Tensor, Metrics]:
    return pacs_loss(
        logp, pacs_anchor(b, logp, cfg), b.response_mask, b.scores, b.group_size, cfg, b.group_ids, b.is_weights
    )


def pacs_anchor(b: TrainBatch, logp: torch.Tensor, cfg: Any) -> torch.Tensor:
    """The log-probs PACS's implicit reward is measured against (``PACSConfig.anchor``)."""
    if getattr(cfg, "anchor", "old") == "old":
        return b.old_logp
    if b.ref_logp is None:
        raise ValueError("algorithm.pacs.anchor=reference needs TrainBatch.ref_logp (the reference policy's log-probs)")
    return b.ref_logp.to(logp.dtype)


def _clipped(
    b: TrainBatch, logp: torch.Tensor, cfg: Any, entropy: torch.Tensor | None = None
) -> tuple[torch.Tensor, Metrics]:
    return clipped_policy_loss(logp, b.old_logp, b.response_mask, b.advantages, cfg, b.is_weights)


# GRPO and PPO-clip share the clipped surrogate; they differ in the advantage (AlgorithmConfig.
# loss_config resolves policy.adv_estimator=auto: grpo -> group-normalised, ppo -> leave-one-out,
# i.e. PPO-clip with a critic-free baseline; policy.adv_estimator=gae gives per-token GAE advantages
# from the learned critic, filled in by critic_stages before the update).
register_loss("grpo", needs_advantages=True, unit="agg")(_clipped)
register_loss("ppo", needs_advantages=True, unit="agg")(_clipped)


@register_loss("gspo", needs_advantages=True, unit="agg")
def _gspo(
    b: TrainBatch, logp: torch.Tensor, cfg: Any, entropy: torch.Tensor | None = None
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (pacs/policy_loss.py::gspo_policy_loss) with outcome advantages (GSPOConfig: GRPO's by default)."""
    return gspo_policy_loss(logp, b.old_logp, b.response_mask, b.advantages, cfg, b.is_weights)


@register_loss("sft", unit="token")
def _sft(
    b: TrainBatch, logp: torch.Tensor, cfg: Any, entropy: torch.Tensor | None = None
) -> tuple[torch.Tensor, Metrics]:
    """Supervised warm-up: token-mean negative log-likelihood of the response tokens (``cfg``, the old
    log-probs and the advantages unused). The CPU recipe uses it to teach the answer *format* before RL."""
    m = b.response_mask.to(logp.dtype)
    loss = -(logp * m).sum() / m.sum().clamp(min=1.0)
    return loss, {"sft/loss": loss.detach()}
