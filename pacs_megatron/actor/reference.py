"""The frozen reference policy of the KL term (``algorithm.kl_loss_coef`` > 0) and of PACS v2's anchor
(``algorithm.pacs.anchor=reference``); one copy serves both, and it is absent otherwise.

    ref = ReferencePolicy(actor)                         # built beside the actor, same TP/PP/VPP layout
    ref_logp = ref.logprobs(actor, batch, mbs, T, packed, thd)   # no grad; [B, T] on every rank

A second set of megatron chunks on the actor's process groups (no DDP, optimizer or gradients), copied from
the actor the first time it is needed and saved with every checkpoint. A hard reset
(``algorithm.reference_reset_every``) copies the live policy in (:meth:`ReferencePolicy.copy_from`) and
re-initialises Adam, so the next step trains as a fresh start would; the lr schedule keeps its position.
Lifecycle, resets, the asynchronous loop and memory (``actor.offload_reference``): docs/pacs_v2.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from pacs_megatron.actor.forward import forward_logprobs
from pacs_megatron.actor.logit_rows import set_fused_head
from pacs_megatron.actor.policy_model import build_policy_model
from pacs_megatron.actor.weights import unwrap
from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.run.layout import StepLayout
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class ReferencePolicy:
    """Frozen copy of the policy at the start of RL, on the actor's layout (see the module docstring)."""

    def __init__(self, actor) -> None:

        cfg, groups = actor.sections, actor.groups
        self.groups, self.spec = groups, actor.spec
        # the actor's builder without adapters or a base: the weights come from copy_from or a checkpoint
        self.config, self.chunks = build_policy_model(
            actor.spec,
            groups,
            actor.param_dtype,
            seed=cfg.model.seed,
            sequence_parallel=cfg.parallel.sequence_parallel,
            recompute=False,  # forward only: nothing to recompute
            routing_replay=cfg.actor.routing_replay == "rollout",
        )
        set_fused_head(self.chunks, actor.fused_head)  # as the actor's (ops/head.py)
        for c in self.chunks:
            c.eval()
            c.requires_grad_(False)
        self.ready = False
        """Whether the weights are the reference's (copied from the actor or loaded); else the init's."""
        self.reset_step = 0
        """The RL step after whose update the reference was last reset to the live policy
        (algorithm.reference_reset_every; 0: the policy RL started from). Checkpointed by the trainer."""
        self.offload_enabled = bool(cfg.actor.offload_reference)
        self._storages: list[tuple[torch.UntypedStorage, int, torch.Tensor]] = []
        self._offloaded = False
        self.offload()
        n = sum(p.numel() for c in self.chunks for p in c.parameters())
        logger.info("KL reference policy: %d parameters on rank %d, offload %s", n, groups.rank, self.offload_enabled)

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def copy_from(self, actor) -> None:
        """The actor's current weights (parameters and buffers) become the reference's."""
        self.restore()
        for a, r in zip(actor.model, self.chunks):
            src = dict(unwrap(a).named_parameters()) | dict(unwrap(a).named_buffers())
            for name, t in list(r.named_parameters()) + list(r.named_buffers()):
                t.copy_(src[name])
        self.ready = True
        self.offload()

    def ensure_ready(self, actor) -> None:
        if not self.ready:
            logger.info("reference policy: a frozen copy of the actor's weights at iteration %d", actor.iteration)
            self.copy_from(actor)

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
        """No-grad ``[B, T]`` float32 reference log-probs of this DP rank's rows (collective), computed on
        the micro-batches (``packed``) and LM-head rows (``response_only``) the actor's own log-prob pass
        uses, so that before any update they equal the actor's bit for bit."""
        self.ensure_ready(actor)
        self.restore()
        try:
            token_logp, _ = forward_logprobs(
                self.chunks,
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
            self.offload()
        return token_logp

    # ------------------------------------------------------------------ checkpoints

    def _sharded_state(self) -> dict:
        models = [unwrap(c) for c in self.chunks]
        if len(models) == 1:
            return {"model": models[0].sharded_state_dict()}
        return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}

    def save(self, actor, path: str | Path) -> None:
        """Collective: write the reference's weights under ``path/reference`` (the policy RL started from)."""
        from megatron.core import dist_checkpointing

        self.ensure_ready(actor)
        target = StepLayout(Path(path)).reference.path
        if self.groups.rank == 0:
            target.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        self.restore()
        try:
            dist_checkpointing.save(self._sharded_state(), str(target))
        finally:
            self.offload()
        dist.barrier()

    def load(self, path: str | Path) -> None:
        """Collective: restore what :meth:`save` wrote (any layout); without it the reference is taken
        from the actor at its next use (the resumed policy), with a warning."""
        from megatron.core import dist_checkpointing

        reference = StepLayout(Path(path)).reference
        target = reference.path
        if not reference.metadata_json.is_file():
            logger.warning(
                "checkpoint %s holds no reference policy (algorithm.kl_loss_coef was 0 when it was written): the "
                "KL term's reference is the resumed policy",
                path,
            )
            self.ready = False
            return
        self.restore()
        loaded = dist_checkpointing.load(self._sharded_state(), str(target))
        models = [unwrap(c) for c in self.chunks]
        for i, model in enumerate(models):
            model.load_state_dict(loaded["model" if len(models) == 1 else f"model{i}"])
        self.ready = True
        self.offload()
        dist.barrier()

    # ------------------------------------------------------------------ host offload

    def offload(self) -> None:
        """With ``actor.offload_reference``: weights to host memory, device storages freed."""
        if not self.offload_enabled or self._offloaded:
            return
        cuda = self.groups.device.type == "cuda"
        if not self._storages:  # first offload: one pinned host buffer per distinct storage, reused after
            seen: set[int] = set()
            for st in self._all_storages():
                if st.nbytes() and st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=cuda)
                    self._storages.append((st, st.nbytes(), host))
        for st, _, host in self._storages:
            host.untyped_storage().copy_(st, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()  # the copies must land before the device storages go
        for st, _, _ in self._storages:
            st.resize_(0)
        self._offloaded = True

    def restore(self) -> None:
        """Weights back on the device (no-op unless offloaded)."""
        if not self._offloaded:
            return
        cuda = self.groups.device.type == "cuda"
        for st, n, host in self._storages:
            st.resize_(n)
            st.copy_(host.untyped_storage(), non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        self._offloaded = False

    @property
    def resident_bytes(self) -> int:
        """Bytes of the reference's weights on the device now (0 while offloaded)."""
        return sum({st.data_ptr(): st.nbytes() for st in self._all_storages() if st.nbytes()}.values())

    def _all_storages(self) -> list[torch.UntypedStorage]:
        return [t.untyped_storage() for c in self.chunks for t in list(c.parameters()) + list(c.buffers())]
