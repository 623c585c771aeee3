"""The reference policy of a LoRA actor: the base model, its adapters switched off (no second copy).

With ``actor.lora.rank`` > 0 the KL term's and PACS v2's reference is the actor's own chunks with every
adapter off (actor/lora/adapters.py ``adapters_off``): the frozen base is exactly the policy RL started from
(B = 0 at step 0), so no weights are copied, offloaded or checkpointed apart from the actor's.

A v2 hard reset (``algorithm.reference_reset_every``) merges the adapters into the base and starts them
again from PEFT's init (``merge_and_restart``): the reference becomes the live policy, as the paper asks,
and the policy is unchanged by the reset itself. The other choice, keeping the base and snapshotting the
adapters as the reference's, would keep an adapter-only export valid but costs a copy of the adapters and
a second adapter set in every forward; docs/lora.md compares the two. An actor checkpoint keeps the merged
adapters and replays them onto the pretrained base on load (actor/lora/checkpoint.py), so a resume across a
reset is exact.

The interface is :class:`~pacs_megatron.actor.reference.ReferencePolicy`'s.
"""

from __future__ import annotations

from pathlib import Path

from pacs_megatron.actor.forward import forward_logprobs
from pacs_megatron.actor.lora.adapters import adapters_off, merge_and_restart
from pacs_megatron.actor.weights import unwrap
from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class LoRAReference:
    """The base model under the actor's adapters (see the module docstring)."""

    ready = True
    """Always: the base is the reference from the start."""
    resident_bytes = 0
    """No weights of its own."""

    def __init__(self, actor) -> None:
        self.groups, self.spec = actor.groups, actor.spec
        self.reset_step = 0
        """The RL step after whose update the reference was last reset (checkpointed by the trainer)."""
        logger.info("reference policy: the LoRA actor's base model (adapters off), no copy")

    def copy_from(self, actor) -> None:
        """The live policy becomes the reference: adapters merged into the base and restarted; the
        optimizer's copies of the adapters follow (its state is re-initialised by the caller)."""
        actor.offloader.restore()
        for c in actor.model:  # A redrawn from the optimizer step count: checkpointed, so a resume is exact
            merge_and_restart(unwrap(c), actor.iteration, self.groups.tp_rank, self.groups.tp_size)
        actor.optimizer.reload_model_params()  # fp32 main copies of the (re-initialised) adapters

    def ensure_ready(self, actor) -> None:
        """Nothing to build: the base is there."""

    def logprobs(
        self,
        actor,
        batch: Rollouts,
        micro_batch_size: int,
        temperature: float,
        packed,
        thd: bool,
        response_only: bool = False,
    ):
        """No-grad ``[B, T]`` log-probs of the base (adapters off) on the actor's micro-batches (collective)."""
        for c in actor.model:
            c.eval()
        try:
            with adapters_off([unwrap(c) for c in actor.model]):
                token_logp, _ = forward_logprobs(
                    actor.model,
                    batch,
                    micro_batch_size,
                    self.spec,
                    self.groups,
                    temperature,
                    False,
                    packed,
                    thd,
                    response_only,
                )
        finally:
            for c in actor.model:
                c.train()
        return token_logp

    def save(self, actor, path: str | Path) -> None:
        """Nothing beyond the actor's checkpoint, from which the (merged) base is rebuilt."""

    def load(self, path: str | Path) -> None:
        """Nothing beyond the actor's checkpoint."""

    def offload(self) -> None:
        """No weights of its own to offload."""

    def restore(self) -> None:
        """No weights of its own to restore."""
