"""Records that cross the rollout boundary (engine in, responses out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    Example:
        >>> SamplingParams(n=8, temperature=1.0, max_tokens=256).top_p
        1.0
    """

    n: int = 1
    """Responses per prompt."""
    temperature: float = 1.0
    """Softmax temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus mass; 1 disables it."""
    top_k: int = -1
    """Top-k; -1 disables it."""
    max_tokens: int = 256
    """Most tokens generated per response."""
    seed: int | None = None
    """Seed of this call (None: engine default)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the tokenizer's EOS."""


@dataclass(frozen=True)
class Response:
    """One generated response.

    Example:
        >>> Response(token_ids=(17, 2), text="7", finish_reason="stop").truncated
        False
    """

    token_ids: tuple[int, ...]
    """Generated tokens, the EOS included when generation stopped on it."""
    text: str
    """Decoded text without special tokens."""
    finish_reason: str
    """"stop" (EOS or a stop token) or "length" (hit max_tokens: truncated)."""
    logprobs: tuple[float, ...] | None = field(default=None, compare=False)
    """The engine's log-prob of each generated token under the distribution it was drawn from: logits / T,
    then top-k, then top-p, renormalised (the same on every engine: rollout/hf_engine.py sampling_logits)."""
    routed_experts: Any = field(default=None, compare=False, repr=False)
    """MoE routing replay: ``[prompt + response tokens, layers, k]`` int16 tensor of the experts the
    engine's routers chose for each token (None unless the engine records them)."""

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"
