"""One registry for the trainable losses: each registers its function and its traits (:class:`LossTraits`), so the
trainer selects PACS or a baseline by name and asks the registry what the loss needs, never its name.

A loss takes a :class:`~pacs_megatron.batch.rows.TrainBatch` (one micro-batch of whole groups), the current
policy's differentiable log-probs ``logp [B, T]``, its config section (``LossTraits.section``, as
``AlgorithmConfig.loss_config()`` gives it) and the policy's token entropy when it asks for it
(``LossSpec.needs_entropy``), and returns ``(loss, metrics)``, where ``loss`` is a *mean* over the loss's unit
(rows, or response tokens for ``token-mean``). ``denominator`` reports that unit count, so a caller that splits a
mini-batch into micro-batches (and data-parallel ranks) weights each by ``denominator / total`` and gets exactly
the full mini-batch's loss. The module imports no torch (the losses import their maths when called): the config
layer reads the traits in the launcher's parent, which starts the ranks without torch (tests/test_cli.py).

Example:
    >>> import torch
    >>> from pacs_megatron.pacs.config import PACSConfig
    >>> from pacs_megatron.batch.rows import loss_batch
    >>> b = loss_batch(torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([1.0, 0.0]), 2)
    >>> loss, m = LOSSES["pacs"].fn(b, torch.zeros(2, 3), PACSConfig())
    >>> round(loss.item(), 4)  # psi = 0 for both rows: BCE(0, y) = log 2
    0.6931
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pacs_megatron.batch.rows import Rollouts, TrainBatch

LossFn = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
"""``fn(batch: TrainBatch, logp: Tensor, cfg, entropy: Tensor | None = None) -> (loss, metrics)``."""
AdvantageFn = Callable[["torch.Tensor", int, Any], "torch.Tensor"]
"""``fn(scores [B], group_size, section) -> advantages [B]``, from a step's 0/1 rewards."""
PostUpdateFn = Callable[["TrainBatch", "torch.Tensor", Any], "dict[str, torch.Tensor]"]
"""``fn(batch, logp [B, T], section) -> metrics``, the loss's state at the log-probs after the step's update."""
Metrics = dict[str, "torch.Tensor"]
CORRECTION_UNITS = ("token", "row")


@dataclass(frozen=True)
class LossTraits:
    """What the trainer asks of a loss, declared at its registration (as verl's ``register_policy_loss``
    keeps a loss's settings beside it): config/, loop/ and actor/ branch on these, never on the name."""

    section: str | None = None
    """The ``algorithm`` field holding its settings ("pacs", "policy", "gspo"), passed to it as ``cfg``;
    None: it reads none (``cfg`` is None)."""
    correction_unit: str = "token"
    """What rollout correction weighs: "token", or "row" for a loss of whole sequences (PACS's BCE), whose
    importance ratio is then sequence-level (``algorithm.is_level=auto``; a token-level one is refused)."""
    outcome_advantages: AdvantageFn | None = None
    """Its rows' advantages from the step's 0/1 rewards, before the update; None: zeros (it reads none)."""
    auto_estimator: str = "grpo"
    """What its section's ``adv_estimator=auto`` resolves to (ppo: "rloo")."""
    shaped_rewards: bool = True
    """Whether it takes length-shaped rewards (``algorithm.overlong.buffer_len``); a classifier of the 0/1
    outcome (PACS) does not."""
    gae: bool = False
    """Whether its section's ``adv_estimator=gae`` trains the learned critic (``critic:``) for GAE advantages."""
    anchored: bool = False
    """Whether its section's ``anchor`` names the log-probs it is measured against: "old" (pi_old, so one
    update per step takes it where it starts) or "reference" (a frozen reference policy is built)."""
    post_update: PostUpdateFn | None = None
    """Its metrics after the step's update, at the new log-probs of the same rows (loop/diagnostics.py, switch
    ``logging.post_update_metrics``); None: none."""

    def __post_init__(self) -> None:
        if self.correction_unit not in CORRECTION_UNITS:
            raise ValueError(f"correction_unit={self.correction_unit!r}: choose one of {list(CORRECTION_UNITS)}")

    def anchor(self, section: Any) -> str:
        """The log-probs it is measured against under ``section``: "old" (pi_old) or "reference"."""
        return str(section.anchor) if self.anchored else "old"


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: the function, the unit its mean averages over, and its traits."""

    fn: LossFn
    unit: str = "row"
    """What the returned mean averages over: "row", "group" (rows, less those left alone in their group: a group
    baseline's loss, PACS), "token", or "agg" (the config's loss_agg_mode)."""
    needs_entropy: bool = False
    """Whether the loss reads the current policy's entropy (the train step then asks the kernel for it)."""
    traits: LossTraits = field(default_factory=LossTraits)
    """What the rest of the trainer asks of it."""

    def denominator(self, rows: Rollouts, config: Any) -> torch.Tensor:
        """How many units (response tokens or rows) this micro-batch's mean averages over; units that
        masked IS rejected (weight 0) are not counted, as the losses leave them out of their means. It
        reads the masks only, so it is known before the forward."""
        import torch

        from pacs_megatron.pacs.advantage import drop_lone_rows
        from pacs_megatron.pacs.rollout_correction import kept_mask, kept_rows

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


def register_loss(name: str, *, unit: str = "row", traits: LossTraits | None = None) -> Callable[[LossFn], LossFn]:
    """Decorator: make ``fn`` selectable as ``algorithm.loss=name``, with its unit (see LossSpec) and traits
    (default: a token-level loss that reads no config section and no advantages)."""
    if unit not in ("row", "group", "token", "agg"):
        raise ValueError(f"unit={unit!r}: choose row, group, token or agg")

    def deco(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = LossSpec(fn, unit, traits=traits or LossTraits())
        return fn

    return deco


def get_loss(name: str) -> LossSpec:
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"algorithm.loss={name!r} is not registered: choose one of {sorted(LOSSES)}") from None


def losses_where(has: Callable[[LossTraits], bool]) -> str:
    """The registered losses whose traits have ``has``, as an error message names them ("grpo/ppo")."""
    return "/".join(sorted(name for name, spec in LOSSES.items() if has(spec.traits)))


# The built-in losses. Their maths is imported when first called (module docstring).


def pacs_anchor(b: TrainBatch, logp: torch.Tensor, cfg: Any) -> torch.Tensor:
    """The log-probs PACS's implicit reward is measured against (``PACSConfig.anchor``)."""
    if getattr(cfg, "anchor", "old") == "old":
        return b.old_logp
    if b.ref_logp is None:
        raise ValueError("algorithm.pacs.anchor=reference needs TrainBatch.ref_logp (the reference policy's log-probs)")
    return b.ref_logp.to(logp.dtype)


def _pacs_advantages(scores: torch.Tensor, group_size: int, cfg: Any) -> torch.Tensor:
    """PACS's ``adv_estimator`` of the rewards R: the per-row weight of its gradient while psi = 0 (the loss
    computes its own score from r)."""
    from pacs_megatron.pacs.advantage import group_advantage

    return group_advantage(scores.float(), group_size, cfg.adv_estimator)


POST_PREFIX = "pacs/post_"
POST_SKIP = ("pacs/mixed_group_frac", "pacs/lone_row_groups")
"""Not recomputed after the update: properties of the rewards and the row weights, not of the classifier."""
QUANTILES = (0.1, 0.5, 0.9)


def _pacs_post_update(b: TrainBatch, logp: torch.Tensor, cfg: Any) -> Metrics:
    """The classifier after the update (loop/diagnostics.py says why): PACS's metrics at ``logp`` against its own
    anchor, over the rows the loss kept, with psi's quantiles, named ``pacs/post_*``."""
    import torch

    from pacs_megatron.pacs.advantage import group_advantage
    from pacs_megatron.pacs.implicit import implicit_reward
    from pacs_megatron.pacs.loss import pacs_loss
    from pacs_megatron.pacs.rollout_correction import kept_rows

    anchor = pacs_anchor(b, logp, cfg).float()
    w = b.is_weights  # the loss's row weights: a dropped row (weight 0) is out of every metric, as of the loss
    _, m = pacs_loss(logp, anchor, b.response_mask, b.scores, b.group_size, cfg, is_weights=w)
    keep = kept_rows(len(logp), w, logp.device) if w is not None else None
    r = implicit_reward(logp, anchor, b.response_mask, cfg.beta, cfg.reward_method)
    psi = group_advantage(r, b.group_size, cfg.adv_estimator, cfg.norm_adv_by_std, keep)
    psi = psi if keep is None else psi[keep]
    for q, v in zip(QUANTILES, torch.quantile(psi.double(), torch.tensor(QUANTILES, dtype=torch.float64))):
        m[f"pacs/psi_p{round(q * 100)}"] = v
    return {POST_PREFIX + k.removeprefix("pacs/"): v for k, v in m.items() if k not in POST_SKIP}


PACS_TRAITS = LossTraits(
    section="pacs",
    correction_unit="row",
    outcome_advantages=_pacs_advantages,
    shaped_rewards=False,
    anchored=True,
    post_update=_pacs_post_update,
)


@register_loss("pacs", unit="group", traits=PACS_TRAITS)
def _pacs(
    b: TrainBatch, logp: torch.Tensor, cfg: Any, entropy: torch.Tensor | None = None
) -> tuple[torch.Tensor, Metrics]:
    from pacs_megatron.pacs.loss import pacs_loss

    return pacs_loss(
        logp, pacs_anchor(b, logp, cfg), b.response_mask, b.scores, b.group_size, cfg, b.group_ids, b.is_weights
    )


def _outcome_advantages(scores: torch.Tensor, group_size: int, cfg: Any) -> torch.Tensor:
    """The baselines' advantages from the 0/1 rewards (pacs/policy_loss.py::outcome_advantages)."""
    from pacs_megatron.pacs.policy_loss import outcome_advantages

    return outcome_advantages(scores, group_size, cfg)


def _clipped(
    b: TrainBatch, logp: torch.Tensor, cfg: Any, entropy: torch.Tensor | None = None
) -> tuple[torch.Tensor, Metrics]:
    from pacs_megatron.pacs.policy_loss import clipped_policy_loss

    return clipped_policy_loss(logp, b.old_logp, b.response_mask, b.advantages, cfg, b.is_weights)


# GRPO and PPO-clip share the clipped surrogate and the section ``policy``; they differ in the advantage that
# policy.adv_estimator=auto gives (grpo: group-normalised; ppo: leave-one-out, i.e. PPO-clip with a critic-free
# baseline); policy.adv_estimator=gae gives per-token GAE advantages from the learned critic (critic_stages).
CLIPPED_TRAITS = LossTraits(section="policy", outcome_advantages=_outcome_advantages, gae=True)
register_loss("grpo", unit="agg", traits=CLIPPED_TRAITS)(_clipped)
register_loss("ppo", unit="agg", traits=replace(CLIPPED_TRAITS, auto_estimator="rloo"))(_clipped)


@register_loss("gspo", unit="agg", traits=LossTraits(section="gspo", outcome_advantages=_outcome_advantages))
def _gspo(
    b: TrainBatch, logp: torch.Tensor, cfg: Any, entropy: torch.Tensor | None = None
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (pacs/policy_loss.py::gspo_policy_loss) with outcome advantages (GSPOConfig: GRPO's by default)."""
    from pacs_megatron.pacs.policy_loss import gspo_policy_loss

    return gspo_policy_loss(logp, b.old_logp, b.response_mask, b.advantages, cfg, b.is_weights)


@register_loss("sft", unit="token", traits=LossTraits(shaped_rewards=False))  # it reads no rewards
def _sft(
    b: TrainBatch, logp: torch.Tensor, cfg: Any, entropy: torch.Tensor | None = None
) -> tuple[torch.Tensor, Metrics]:
    """Supervised warm-up: token-mean negative log-likelihood of the response tokens (``cfg``, the old
    log-probs and the advantages unused). The CPU recipe uses it to teach the answer *format* before RL."""
    m = b.response_mask.to(logp.dtype)
    loss = -(logp * m).sum() / m.sum().clamp(min=1.0)
    return loss, {"sft/loss": loss.detach()}
