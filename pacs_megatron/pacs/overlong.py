"""DAPO's overlong handling (arXiv 2503.14476, section 3.4): soft punishment of long responses and
masking of truncated ones. Pure torch; ``[B]`` per response row.

Soft overlong punishment (DAPO eq. 13; verl ``workers/reward_manager/dapo.py``), with L_max the
maximum response length (rollout.max_response_length), L_cache the buffer and |y| the response's
token count (its EOS included, as verl's ``valid_response_length``)::

    penalty(y) = min(-(|y| - (L_max - L_cache)) / L_cache * factor, 0)
               = 0                                          |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache * factor   L_max - L_cache < |y| <= L_max

and the shaped reward is R + penalty (generation stops at L_max, so |y| never exceeds it and the
paper's third case, -1 beyond L_max, is the factor-1 value at |y| = L_max).

Overlong filtering (DAPO's "mask the loss of truncated samples"): a response cut at L_max gets weight
0 in the loss and leaves the loss's mean and its denominator as a masked-IS rejection does
(rollout_correction.py's "0 = rejected" convention). For GRPO / PPO its 0/1 reward stays in its group's
outcome baseline (as verl and DAPO: no gradient reaches it, its own surrogate is 0); for PACS it leaves
its group (pacs/loss.py): a baseline over it would push gradient into the masked row through the others' psi.

Example:
    >>> overlong_penalty(torch.tensor([10, 16, 18, 20]), max_len=20, buffer_len=4, factor=1.0).tolist()
    [0.0, 0.0, -0.5, -1.0]
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """``[B]`` float32 penalty (<= 0) of responses of ``lengths`` tokens; all 0 when ``buffer_len`` is 0."""
    if buffer_len < 0 or buffer_len > max_len:
        raise ValueError(f"buffer_len={buffer_len} must be in [0, max_len={max_len}]")
    lengths = lengths.to(torch.float32)
    if buffer_len == 0:
        return torch.zeros_like(lengths)
    exceed = lengths - (max_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * factor, max=0.0)


def truncation_weights(truncated: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, 1]`` (or ``weights``' shape) float32: ``weights`` (default 1) with truncated rows set to 0.

    Example:
        >>> truncation_weights(torch.tensor([False, True])).tolist()
        [[1.0], [0.0]]
    """
    keep = (~truncated.bool()).to(torch.float32).reshape(-1, 1)
    return keep if weights is None else weights.to(torch.float32) * keep


def overlong_metrics(penalty: torch.Tensor, truncated: torch.Tensor, masked: bool) -> dict[str, torch.Tensor]:
    """``overlong/penalty_mean`` (over all rows), ``overlong/penalized_frac`` and, when truncated rows are
    masked, ``overlong/masked_frac`` (the truncated fraction itself is ``response/truncation_rate``)."""
    metrics = {"overlong/penalty_mean": penalty.float().mean(), "overlong/penalized_frac": (penalty < 0).float().mean()}
    if masked:
        metrics["overlong/masked_frac"] = truncated.float().mean()
    return metrics
