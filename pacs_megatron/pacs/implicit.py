"""The implicit reward of PACS: how much the policy moved towards a response.

Shapes: B rows (responses), T token positions. ``logp``/``old_logp`` hold log pi(token_t | prefix)
at every position, ``mask`` is 1 on response tokens and 0 on prompt and padding.

    sum_ratio  r_i = beta * sum_t mask_it * (logp_it - old_logp_it)          (paper, method 1)
    mean_logp  r_i = beta * sum_t mask_it * logp_it / sum_t mask_it          (paper, method 2)

The published code sums padded positions too; masking them is deliberate here: a padded
position's log-ratio is noise, and with it the reward would depend on the batch's padding.
"""

from __future__ import annotations

import torch


def implicit_reward(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, beta: float, method: str = "sum_ratio"
) -> torch.Tensor:
    """Per-response implicit reward ``[B]`` (float32 or wider) from ``[B, T]`` log-probs.

    Example:
        >>> lp = torch.tensor([[0.0, -1.0, -2.0]]); m = torch.tensor([[0, 1, 1]])
        >>> implicit_reward(lp, lp - 0.5, m, beta=2.0).tolist()
        [2.0]
    """
    if logp.shape != mask.shape or (old_logp is not None and old_logp.shape != mask.shape):
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape) if old_logp is not None else None} "
            f"and response_mask {tuple(mask.shape)} must all be [B, T]"
        )
    maskf = mask.to(torch.promote_types(logp.dtype, torch.float32))
    if method == "sum_ratio":
        if old_logp is None:
            raise ValueError("reward_method='sum_ratio' needs old_logp")
        return beta * ((logp - old_logp) * maskf).sum(dim=-1)
    if method == "mean_logp":
        # A response with no tokens (empty generation) gets reward 0 rather than 0/0.
        return beta * (logp * maskf).sum(dim=-1) / maskf.sum(dim=-1).clamp(min=1.0)
    raise ValueError(f"reward_method={method!r}: choose 'sum_ratio' or 'mean_logp'")
