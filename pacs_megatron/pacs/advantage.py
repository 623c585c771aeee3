"""Group baselines: from per-response values ``r [B]`` (B = G groups x n responses, each group's
rows contiguous) to scores / advantages ``[B]``.

    rloo   a_i = r_i - mean_{j != i} r_j        = n/(n-1) * (r_i - mean_j r_j)
    grpo   a_i = (r_i - mean_j r_j) / (std_j r_j + eps)   (std unbiased, as torch.std)
    naive  a_i = r_i

PACS applies these to the implicit reward (psi, the "critic"); GRPO and PPO-clip baselines apply
them to the 0/1 verifiable reward (the advantage).

Rows that leave their group (``keep``, PACS: a row with loss weight 0, i.e. a truncated row under
``algorithm.overlong.mask_truncated`` or one that masked IS rejected) are out of every mean and std above:
the baseline is over the group's k kept rows, so no gradient reaches a dropped row through the others'
scores. A group left with one kept row has no baseline: its row gets 0, as a dropped row does, and PACS drops it
(:func:`drop_lone_rows`): verl's rule for a group of one (baseline 0, so a = r) would push a lone wrong row down
while a whole group with one outcome gets no net gradient from a leave-one-out baseline.
"""

from __future__ import annotations

import torch

from pacs_megatron.batch.rows import check_groups

GRPO_EPS = 1e-6


def drop_lone_rows(keep: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """``keep`` without the rows left alone in their group (no baseline, module docstring), and how many groups
    lost their last row that way.

    Example:
        >>> k, n = drop_lone_rows(torch.tensor([True, False, False, False, True, True, False, False]), 4)
        >>> k.tolist(), n
        ([False, False, False, False, True, True, False, False], 1)
    """
    k = keep.reshape(-1, group_size)
    lone = k.sum(dim=1, keepdim=True) == 1
    return (k & ~lone).reshape(-1), int(lone.sum())


def group_advantage(
    values: torch.Tensor,
    group_size: int,
    estimator: str,
    norm_by_std: bool = True,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply a group baseline to ``values [B]`` and return ``[B]`` in the same dtype; ``keep`` (``[B]``
    bool, None: all) names the rows that stay in their group (module docstring).

    Example:
        >>> group_advantage(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, "rloo").tolist()
        [1.0, -1.0, -1.0, 1.0]
        >>> keep = torch.tensor([True, True, True, False])  # row 3 leaves its group
        >>> group_advantage(torch.tensor([1.0, 0.0, 0.5, 3.0]), 4, "rloo", keep=keep).tolist()
        [0.75, -0.75, 0.0, 0.0]
    """
    check_groups(values.numel(), group_size)
    if estimator == "naive":
        return values if keep is None else torch.where(keep, values, torch.zeros_like(values))
    if group_size < 2:
        raise ValueError(f"adv_estimator={estimator!r} needs rollout.n >= 2 (got {group_size}); use 'naive'")
    if keep is None or bool(keep.all()):
        return _full_group_advantage(values, group_size, estimator, norm_by_std)
    # Groups with a dropped row take the kept-rows baseline; the others keep the full one, bit for bit (a
    # dropped row's value, which may be anything, is zeroed first so no NaN reaches a gradient).
    values = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    out = _full_group_advantage(values, group_size, estimator, norm_by_std)
    dropped = (~keep.reshape(-1, group_size)).any(dim=1, keepdim=True)
    kept = _kept_group_advantage(values, group_size, estimator, norm_by_std, keep).reshape(-1, group_size)
    return torch.where(dropped, kept, out.reshape(-1, group_size)).reshape(-1)


def _full_group_advantage(values: torch.Tensor, group_size: int, estimator: str, norm_by_std: bool) -> torch.Tensor:
    r = values.reshape(-1, group_size)
    if estimator == "rloo":
        others_mean = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
        return (r - others_mean).reshape(-1)
    if estimator == "grpo":
        centred = r - r.mean(dim=1, keepdim=True)
        if norm_by_std:
            centred = centred / (r.std(dim=1, keepdim=True) + GRPO_EPS)
        return centred.reshape(-1)
    raise ValueError(f"adv_estimator={estimator!r}: choose 'rloo', 'grpo' or 'naive'")


def _kept_group_advantage(
    values: torch.Tensor, group_size: int, estimator: str, norm_by_std: bool, keep: torch.Tensor
) -> torch.Tensor:
    """:func:`group_advantage` over the kept rows of each group only (a separate path, so that batches with
    every row kept take the one above, bit for bit)."""
    if estimator not in ("rloo", "grpo"):
        raise ValueError(f"adv_estimator={estimator!r}: choose 'rloo', 'grpo' or 'naive'")
    k = keep.reshape(-1, group_size)
    # where, not a product: a dropped row's value may be anything (NaN included) and must not reach a sum
    r = torch.where(k, values.reshape(-1, group_size), torch.zeros((), dtype=values.dtype, device=values.device))
    count = k.sum(dim=1, keepdim=True).to(values.dtype)
    total = r.sum(dim=1, keepdim=True)
    alone = count < 2  # a group of one has no baseline: 0 (module docstring)
    if estimator == "rloo":
        out = torch.where(alone, torch.zeros_like(r), r - (total - r) / (count - 1).clamp(min=1))
    else:
        mean = torch.where(alone, torch.zeros_like(total), total / count.clamp(min=1))
        centred = r - mean
        if norm_by_std:
            var = torch.where(k, centred, torch.zeros_like(centred)).square().sum(1, keepdim=True) / (count - 1).clamp(
                min=1
            )
            # sqrt has an infinite slope at 0 (all kept values equal, e.g. psi = 0 at a step's start): take it
            # where var > 0 only, so the gradient there is 0 as torch.std's is, not 0 * inf = NaN
            positive = var > 0
            std = torch.where(positive, torch.where(positive, var, torch.ones_like(var)).sqrt(), torch.zeros_like(var))
            std = torch.where(alone, torch.ones_like(std), std)
            centred = centred / (std + GRPO_EPS)
        out = torch.where(alone, torch.zeros_like(centred), centred)
    return torch.where(k, out, torch.zeros_like(out)).reshape(-1)
