"""Typed settings of the algorithm math (pure dataclasses, validated at construction)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Optional

REWARD_METHODS = ("sum_ratio", "mean_logp")
ADV_ESTIMATORS = ("rloo", "grpo", "naive")
POLICY_ADV_ESTIMATORS = ("auto", "grpo", "rloo", "gae")
WEIGHT_MODES = (None, "question", "only_positive", "only_negative")
ANCHORS = ("old", "reference")
FILTER_MODES = ("none", "mixed")
"""algorithm.filter_groups: train every group, or only those whose rewards differ (pacs/group_filter.py)."""
KL_TYPES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "kl+", "k3+", "low_var_kl+")
"""algorithm.kl_loss_type: the per-token KL estimators of pacs/regularizers.py (choices live here, torch-free,
so the config layer reads them without importing torch)."""
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_choice(owner: str, field: str, value: object, choices: Collection[object]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{field}={value!r} is not valid: choose one of {list(choices)}")


@dataclass
class PACSConfig:
    """How PACS turns log-probs into a score and the score into a supervised loss.

    Example:
        >>> PACSConfig(beta=2.0, weight_mode="question").adv_estimator
        'rloo'
    """

    beta: float = 1.0
    """Scale of the implicit reward r_i = beta * sum_t (logp - anchor_logp), the anchor pi_old (v1) or the
    reference policy (v2, ``anchor``). The paper uses 1 or 2."""
    reward_method: str = "sum_ratio"
    """"sum_ratio": beta * sum_t mask*(logp - anchor_logp) (the paper's method 1); "mean_logp":
    beta * sum_t mask*logp / sum_t mask (method 2)."""
    adv_estimator: str = "rloo"
    """Score psi from the group's implicit rewards: "rloo" r_i - mean_{j!=i} r_j, "grpo"
    (r - mean)/(std + eps), "naive" r."""
    norm_adv_by_std: bool = True
    """grpo only: divide by the group's unbiased std (+1e-6). False leaves r - mean."""
    weight_mode: Optional[str] = "question"
    """Per-row BCE weights: None (all 1), "question" (sklearn "balanced" class weights within each
    group that has both outcomes), "only_positive" / "only_negative" (zero the other class)."""
    anchor: str = "old"
    """What r_i is measured against: "old" (the paper's v1: pi_old, the policy that sampled the step; psi = 0
    in each step's first mini-batch) or "reference" (v2: a frozen reference policy, the policy RL starts
    from, hard-reset to the live policy every ``algorithm.reference_reset_every`` steps; one copy serves the
    KL term too). "reference" needs reward_method=sum_ratio."""

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"PACSConfig.beta={self.beta} must be > 0 (the paper uses 1.0 or 2.0)")
        _check_choice("PACSConfig", "reward_method", self.reward_method, REWARD_METHODS)
        _check_choice("PACSConfig", "adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        if self.weight_mode in ("none", "None", ""):
            self.weight_mode = None
        _check_choice("PACSConfig", "weight_mode", self.weight_mode, WEIGHT_MODES)
        _check_choice("PACSConfig", "anchor", self.anchor, ANCHORS)
        if self.anchor == "reference" and self.reward_method != "sum_ratio":
            raise ValueError(
                f"PACSConfig.anchor=reference with reward_method={self.reward_method!r}: only sum_ratio measures r "
                "against an anchor; use reward_method=sum_ratio or anchor=old"
            )


@dataclass
class PolicyLossConfig:
    """The baselines' clipped policy-gradient loss (GRPO and PPO-clip).

    Example:
        >>> PolicyLossConfig(clip_ratio_high=0.28).loss_agg_mode
        'token-mean'
    """

    clip_ratio_low: float = 0.2
    """Lower clip: ratios below 1 - clip_ratio_low stop contributing gradient for A < 0."""
    clip_ratio_high: float = 0.2
    """Upper clip: ratios above 1 + clip_ratio_high stop contributing gradient for A > 0."""
    clip_ratio_c: float = 3.0
    """Dual-clip (Ye et al. 2019, arXiv 1912.09729; the reference's default 3.0): for A < 0 the token
    loss is at most -A * clip_ratio_c, so a token whose ratio has grown past clip_ratio_c stops
    pushing. Must be > 1; 0 turns dual-clip off."""
    loss_agg_mode: str = "token-mean"
    """"token-mean" (all tokens of the mini-batch equal), "seq-mean-token-sum", "seq-mean-token-mean",
    "seq-mean-token-sum-norm" (Dr.GRPO: token sums over a constant horizon; the PACS reference's)."""
    adv_estimator: str = "auto"
    """Advantage from the 0/1 verifiable rewards: "grpo" (group-normalised), "rloo" (leave-one-out),
    "gae" (per-token GAE from the learned critic, ``critic:``; the paper's PPO), or "auto": grpo for
    ``algorithm.loss=grpo``, rloo for ``algorithm.loss=ppo``."""
    norm_adv_by_std: bool = True
    """grpo only: divide by the group's std (+1e-6); False gives Dr.GRPO-style r - mean."""
    gamma: float = 1.0
    """gae only: discount (the reference: 1.0)."""
    lam: float = 1.0
    """gae only: GAE lambda (the reference: 1.0)."""
    loss_agg_horizon: int = 0
    """seq-mean-token-sum-norm only: the constant divisor H of the token sums (the recipes: 4096);
    0 (default) is ``rollout.max_response_length``, as verl's fixed response length, resolved by the
    trainer (actor/train_step.py step_loss_config, config/critic.py critic_loss_agg). This config alone
    (``aggregate`` called directly) falls back to the row width T."""

    def __post_init__(self) -> None:
        owner = type(self).__name__  # GSPOConfig shares these checks
        for name in ("clip_ratio_low", "clip_ratio_high"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{owner}.{name}={getattr(self, name)} must be in (0, 1), e.g. 0.2")
        if not (self.clip_ratio_c == 0 or self.clip_ratio_c > 1):
            raise ValueError(f"{owner}.clip_ratio_c={self.clip_ratio_c} must be > 1 (e.g. 3.0) or 0 (off)")
        _check_choice(owner, "loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _check_choice(owner, "adv_estimator", self.adv_estimator, POLICY_ADV_ESTIMATORS)
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{owner}.{name}={getattr(self, name)} must be in [0, 1] (reference: 1)")
        if self.loss_agg_horizon < 0:
            raise ValueError(f"{owner}.loss_agg_horizon={self.loss_agg_horizon} must be >= 0")


@dataclass
class GSPOConfig(PolicyLossConfig):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): the clipped surrogate on a sequence-level ratio, with
    verl's defaults (``actor.policy_loss.loss_mode=gspo``). Same fields as :class:`PolicyLossConfig`;
    only the defaults differ: the length-normalised ratio s_i = exp(mean_t (logp - old_logp)) averages the
    token log-ratios, so it stays much closer to 1 than a token ratio, and its clip range is the paper's
    3e-4 / 4e-4 instead of PPO's 0.2 (pacs/policy_loss.py::gspo_policy_loss).

    Example:
        >>> c = GSPOConfig()
        >>> c.clip_ratio_low, c.clip_ratio_high, c.loss_agg_mode, c.adv_estimator
        (0.0003, 0.0004, 'seq-mean-token-mean', 'grpo')
    """

    clip_ratio_low: float = 3e-4
    """Lower clip of s_i (verl's gspo recipe and the paper: 3e-4)."""
    clip_ratio_high: float = 4e-4
    """Upper clip of s_i (verl and the paper: 4e-4)."""
    clip_ratio_c: float = 0.0
    """Must stay 0: GSPO has no dual-clip (verl's gspo loss applies none)."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """verl's gspo aggregation: each sequence's token mean, then the mean over sequences."""
    adv_estimator: str = "grpo"
    """Group-normalised advantages as GRPO's ("grpo"), or "rloo"; no critic ("gae" is refused)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip_ratio_c:
            raise ValueError(f"GSPOConfig.clip_ratio_c={self.clip_ratio_c}: GSPO has no dual-clip, leave it 0")
        _check_choice("GSPOConfig", "adv_estimator", self.adv_estimator, ("auto", "grpo", "rloo"))


CORRECTION_WEIGHTS = ("tis", "mis")
CORRECTION_MASKS = ("icepop", "geo", "outlier")


def split_correction(spec: str) -> tuple[str, tuple[str, ...]]:
    """``algorithm.rollout_correction`` -> (importance weight, masks): "none", or "+"-joined parts, at most
    one weight (tis, mis) and any masks (icepop, geo, outlier), in any order.

    Example:
        >>> split_correction("icepop+tis"), split_correction("none")
        (('tis', ('icepop',)), ('none', ()))
    """
    if spec == "none":
        return "none", ()
    parts = [p.strip() for p in str(spec).split("+")]
    unknown = [p for p in parts if p not in CORRECTION_WEIGHTS + CORRECTION_MASKS]
    if unknown or len(set(parts)) != len(parts):
        raise ValueError(
            f"{spec!r}: use 'none' or '+'-joined parts, each once, from {list(CORRECTION_WEIGHTS + CORRECTION_MASKS)}"
        )
    weights = [p for p in parts if p in CORRECTION_WEIGHTS]
    if len(weights) > 1:
        raise ValueError(f"{spec!r} names two importance weights: choose tis or mis (both may take masks)")
    return (weights[0] if weights else "none"), tuple(m for m in CORRECTION_MASKS if m in parts)


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """The train/inference mismatch menu, resolved for one loss (built by ``AlgorithmConfig.correction()``;
    pacs/rollout_correction.py applies it). Bounds are on the ratio pi_old / pi_rollout.

    Example:
        >>> RolloutCorrectionConfig(weight="tis", masks=("icepop",)).active
        True
    """

    weight: str = "none"
    """Importance weight: "none" (1), "tis" (min(rho, cap)) or "mis" (rho, 0 outside [1/cap, cap])."""
    masks: tuple[str, ...] = ()
    """Rejection masks, composable with the weight and each other: "icepop" (tokens outside
    ``icepop``), "geo" (rows whose geometric-mean ratio is outside ``geo``), "outlier" (rows with any
    token outside ``outlier``)."""
    cap: float = 2.0
    """The weight's cap C (> 1)."""
    level: str = "token"
    """Unit of the weight's ratio: "token" (rho_t) or "sequence" (prod_t rho_t)."""
    unit: str = "token"
    """What the loss weighs: "token" (weights [B, T]: GRPO / PPO / GSPO) or "row" (weights [B, 1]: PACS's
    per-row BCE; a row with an IcePop-masked token is dropped whole). "row" needs level="sequence"."""
    icepop: tuple[float, float] = (0.5, 2.0)
    """IcePop's token bounds [low, high]."""
    geo: tuple[float, float] = (0.99, 1.01)
    """Bounds of the row's geometric-mean ratio exp(mean_t log rho_t)."""
    outlier: tuple[float, float] = (1e-4, 100.0)
    """Token bounds beyond which the whole row is dropped (SkyRL's suggested 1e-4 / 100; verl's token veto
    is the lower one alone). low=0 / high=inf turn a side off."""

    def __post_init__(self) -> None:
        _check_choice("RolloutCorrectionConfig", "weight", self.weight, ("none", *CORRECTION_WEIGHTS))
        for m in self.masks:
            _check_choice("RolloutCorrectionConfig", "masks", m, CORRECTION_MASKS)
        _check_choice("RolloutCorrectionConfig", "level", self.level, ("token", "sequence"))
        _check_choice("RolloutCorrectionConfig", "unit", self.unit, ("token", "row"))
        if self.unit == "row" and self.level != "sequence":
            raise ValueError("RolloutCorrectionConfig.unit=row weighs whole rows: set level=sequence")
        if not self.cap > 1:
            raise ValueError(f"RolloutCorrectionConfig.cap={self.cap} must be > 1, e.g. 2.0")
        for name in ("icepop", "geo", "outlier"):
            check_ratio_bounds(f"RolloutCorrectionConfig.{name}", getattr(self, name))

    @property
    def active(self) -> bool:
        """Whether anything is weighted or masked (else the losses get no weights at all)."""
        return self.weight != "none" or bool(self.masks)


def check_ratio_bounds(key: str, bounds: Collection[float]) -> None:
    """``bounds`` must be [low, high] with 0 <= low < 1 < high: a ratio of 1 (no mismatch) is always kept."""
    b = list(bounds)
    if len(b) != 2 or not 0 <= b[0] < 1 < b[1]:
        raise ValueError(f"{key}={b} must be [low, high] with 0 <= low < 1 < high, e.g. [0.5, 2.0]")
