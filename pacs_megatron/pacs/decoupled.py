"""The decoupled off-policy correction (pure torch): which log-probs are "old" when the samples come from an
older policy than the one the update starts from (``rollout.max_staleness`` > 0, docs/async.md).

Three policies meet in one update at step s::

    behaviour  pi_b      the engine's weights when it sampled y: version s-1-staleness (Response.logprobs,
                         ``rollout_logp``); with k = 0 the same version as pi_prox, up to engine numerics
    proximal   pi_prox   the actor at the start of step s (version s-1), recomputed by the old-log-prob pass
                         (``old_logp``)
    current    pi_theta  the actor being trained

The ratio of PPO / GRPO and PACS's implicit reward are measured against pi_prox (Hilton et al. 2021; AReaL);
pi_b enters only the weights pi_prox / pi_b of the rollout correction's menu (pacs/rollout_correction.py, the
FP8 path). Why, for PACS: docs/baselines.md, "PACS with stale rollouts".
"""

from __future__ import annotations

import torch

from pacs_megatron.pacs.config import RolloutCorrectionConfig
from pacs_megatron.pacs.rollout_correction import correction_weights, mismatch_metrics


def decoupled_old_logp(
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor | None,
    response_mask: torch.Tensor,
    correction: RolloutCorrectionConfig,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """``(old_logp, is_weights, metrics)`` of the decoupled objective.

    ``old_logp`` is ``proximal_logp`` (the ratio's and the implicit reward's reference); ``is_weights`` are
    the menu's weights pi_prox / pi_b (``correction``: tis / mis and the masks, ``[B, T]`` for a token loss,
    ``[B, 1]`` for PACS), or None when nothing is on or without behaviour log-probs; ``metrics`` are the
    mismatch metrics (``rollout/logprob_diff_*``, ``rollout/kl_seq``, ratio quantiles, ...) and, with
    weights, the menu's (``rollout/is_*``, ``rollout/*_masked_frac``).

    Example:
        >>> from pacs_megatron.pacs.config import RolloutCorrectionConfig
        >>> prox = torch.tensor([[0.0, -1.0]]); behaviour = torch.tensor([[0.0, -1.5]]); mask = torch.tensor([[0, 1]])
        >>> tis = RolloutCorrectionConfig(weight="tis", cap=2.0, level="sequence", unit="row")
        >>> old, w, _ = decoupled_old_logp(prox, behaviour, mask, tis)
        >>> torch.equal(old, prox), round(w.item(), 4)
        (True, 1.6487)
    """
    if behaviour_logp is None:
        return proximal_logp, None, {}
    metrics = mismatch_metrics(proximal_logp, behaviour_logp, response_mask)
    w, m = correction_weights(proximal_logp, behaviour_logp, response_mask, correction)
    return proximal_logp, w, metrics | m


def staleness(versions: torch.Tensor, proximal_version: int) -> torch.Tensor:
    """Per-row staleness: how many policy versions older than the proximal policy each sample's is.

    Example:
        >>> staleness(torch.tensor([4, 4, 3]), proximal_version=4).tolist()
        [0, 0, 1]
    """
    s = proximal_version - versions.long()
    if bool((s < 0).any()):
        raise ValueError(
            f"a sample of version {int(versions.max())} is newer than the proximal policy {proximal_version}"
        )
    return s


def staleness_metrics(versions: torch.Tensor, proximal_version: int, max_staleness: int) -> dict[str, float]:
    """``async/staleness_mean|max`` and ``async/staleness_frac_<j>`` (fraction of rows j versions old) for
    j = 0..max_staleness.

    Example:
        >>> m = staleness_metrics(torch.tensor([4, 3, 3, 3]), 4, max_staleness=1)
        >>> m["async/staleness_mean"], m["async/staleness_max"], m["async/staleness_frac_1"]
        (0.75, 1.0, 0.75)
    """
    s = staleness(versions, proximal_version).double()
    out = {"async/staleness_mean": float(s.mean()), "async/staleness_max": float(s.max())}
    for j in range(max_staleness + 1):
        out[f"async/staleness_frac_{j}"] = float((s == j).double().mean())
    return out
