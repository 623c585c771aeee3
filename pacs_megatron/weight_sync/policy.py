"""What the weight sync asks of the actor: :class:`PolicyWeights`, which actor/actor.py's ``MegatronActor``
satisfies. weight_sync/ sits above actor/ and does not import it; a test's stand-in actor implements the
methods its sync calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from pacs_megatron.batch.rows import Rollouts


class TokenLogprobs(Protocol):
    """Log-probs of a batch (actor/actor.py ``LogprobResult``)."""

    @property
    def token_logp(self) -> torch.Tensor:
        """``[B, T]`` log-prob of each token given the ones before it (0 at position 0)."""
        ...


class ResetMark(Protocol):
    """The actor's frozen reference policy, as far as the sync cares (actor/reference.py)."""

    @property
    def reset_step(self) -> int:
        """The step of the last PACS v2 reset, which merged a LoRA actor's adapters into its base (0: none)."""
        ...


class RankOf(Protocol):
    """This process's place in the job (parallel/groups.py ``ParallelGroups``)."""

    @property
    def rank(self) -> int:
        """Global rank."""
        ...

    @property
    def cp_rank(self) -> int:
        """Rank in its context-parallel group (0 without CP)."""
        ...


class PolicyWeights(Protocol):
    """The actor's side of a weight sync (collective methods are called on every trainer rank)."""

    @property
    def groups(self) -> RankOf:
        """Its process groups (the adapter sync names its directory after the rank; the sync to engines on
        other ranks reads the CP rank)."""
        ...

    @property
    def reference(self) -> ResetMark | None:
        """Its frozen reference policy, None without one: which base a LoRA actor holds."""
        ...

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: full Hugging Face-named tensors, one at a time, in the same order on every rank."""
        ...

    def export_base_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: :meth:`export_hf_weights` with every LoRA adapter off (the frozen base)."""
        ...

    def peft_adapter(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Collective: the LoRA adapters as PEFT-named full CPU tensors, with their ``adapter_config.json``."""
        ...

    def compute_logprobs(self, batch: Rollouts, micro_batch_size: int, temperature: float) -> TokenLogprobs:
        """Collective: no-grad log-probs of ``batch`` under the current weights (the probe's reference)."""
        ...

    def swapped_hf_weights(self, tensors: dict[str, torch.Tensor]) -> AbstractContextManager[object]:
        """Hold these HF-named tensors instead of the trained ones inside the context (the quantized probe)."""
        ...
