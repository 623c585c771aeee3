"""The typed record returned by the log-prob ops (fused and reference alike)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LogprobOutput:
    """Per-token log-probs of the targets, their masked per-sequence sum, and optionally the entropy.

    Shapes are those of ``targets``: ``[B, T]`` for 3-D logits ``[B, T, V_local]`` (``[N]`` for 2-D
    logits ``[N, V_local]``, where ``seq_logp`` is then a 0-dim tensor). Dtype float32 (float64 for
    float64 logits). All fields are differentiable w.r.t. the logits.

    Example:
        >>> out = fused_logprobs(logits, input_ids[:, 1:], mask[:, 1:], temperature=1.0)
        >>> out.token_logp.shape, out.seq_logp.shape      # (B, T-1), (B,)
    """

    token_logp: torch.Tensor
    """[B, T] log softmax(logits / temperature)[target]; 0 where the target id is outside [0, V_global)."""
    seq_logp: torch.Tensor | None = None
    """[B] sum over t of token_logp where mask is true (masked positions add exactly nothing); None without mask."""
    entropy: torch.Tensor | None = None
    """[B, T] entropy -sum_v p_v log p_v of softmax(logits / temperature) over the full vocab; None unless asked."""
