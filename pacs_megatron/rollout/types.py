"""Records that cross the rollout boundary (engine in, responses out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pacs_megatron.config import RolloutConfig


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
    stop: tuple[str, ...] = ()
    """Stop strings (a multi-turn rollout's tool-call close, rollout/multi_turn.py): a response ends with the
    token whose text completes one of them, that token included (both engines; finish_reason "stop")."""

    @classmethod
    def of_rollout(cls, r: RolloutConfig, n: int | None = None, seed: int | None = None) -> SamplingParams:
        """What RL samples with (``rollout.*``); ``n`` and ``seed`` given for a stream of its own (the tool
        warm-up's check)."""
        return cls(
            n=r.n if n is None else n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_response_length,
            seed=r.seed if seed is None else seed,
        )


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

    policy_mask: tuple[bool, ...] | None = field(default=None, compare=False)
    """Multi-turn rollouts: per token of ``token_ids``, True where the policy sampled it and False on tool
    output (context the model reads but never chose: no loss, no log-prob, no KL). None: every token is the
    policy's. ``logprobs`` then holds the policy tokens' values only, in order."""
    cached_tokens: int | None = field(default=None, compare=False)
    """Prompt tokens the engine served from its prefix cache (vLLM's ``num_cached_tokens``, the same for a
    prompt's ``n`` samples); None where the engine does not say (HF). The turn loop's prefix-cache reuse."""
    turns: Any = field(default=None, compare=False, repr=False)
    """Multi-turn rollouts: the trajectory's counters (rollout/multi_turn.py ``TurnStats``); None otherwise."""

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def policy_tokens(self) -> int:
        """How many of ``token_ids`` the policy sampled (all of them in a single-turn rollout).

        Example:
            >>> r = Response(token_ids=(5, 6, 7), text="", finish_reason="stop", policy_mask=(True, False, True))
            >>> r.policy_tokens
            2
        """
        return len(self.token_ids) if self.policy_mask is None else sum(self.policy_mask)
