"""Group baselines: from per-response values ``r [B]`` (B = G groups x n responses, each group's
rows contiguous) to scores / advantages ``[B]``.

    rloo   a_i = r_i - mean_{j != i} r_j        = n/(n-1) * (r_i - mean_j r_j)
    grpo   a_i = (r_i - mean_j r_j) / (std_j r_j + eps)   (std unbiased, as torch.std)
    naive  a_i = r_i

PACS applies these to the implicit reward (psi, the "critic"); GRPO and PPO-clip baselines apply
them to the 0/1 verifiable reward (the advantage).
"""

from __future__ import annotations

import torch

GRPO_EPS = 1e-6


def check_groups(num_rows: int, group_size: int, group_ids: torch.Tensor | None = None) -> None:
    """Rows must come in whole, contiguous groups of ``group_size`` (a group split across a
    micro-batch or interleaved with another would silently give wrong baselines)."""
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1 (rollout.n)")
    if num_rows % group_size != 0:
        raise ValueError(
            f"batch of {num_rows} rows is not a whole number of groups of {group_size}: micro-batches "
            "must hold whole prompt groups (make micro_batch_size a multiple of rollout.n)"
        )
    if group_ids is not None:
        ids = group_ids.reshape(-1, group_size)
        if not bool((ids == ids[:, :1]).all()):
            bad = int((ids != ids[:, :1]).any(dim=1).nonzero()[0, 0])
            raise ValueError(
                f"rows {bad * group_size}..{(bad + 1) * group_size - 1} do not share one prompt: the "
                f"{group_size} responses of a prompt must be contiguous rows"
            )
        firsts = ids[:, 0]
        if firsts.numel() != torch.unique(firsts).numel():
            raise ValueError("a prompt's responses appear in two separate blocks: groups must be contiguous")


def group_advantage(values: torch.Tensor, group_size: int, estimator: str, norm_by_std: bool = True) -> torch.Tensor:
    """Apply a group baseline to ``values [B]`` and return ``[B]`` in the same dtype.

    Example:
        >>> group_advantage(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, "rloo").tolist()
        [1.0, -1.0, -1.0, 1.0]
    """
    check_groups(values.numel(), group_size)
    if estimator == "naive":
        return values
    if group_size < 2:
        raise ValueError(f"adv_estimator={estimator!r} needs rollout.n >= 2 (got {group_size}); use 'naive'")
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
