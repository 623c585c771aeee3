"""MegatronActor: the policy the trainer and weight sync talk to (TP x PP x DP megatron-core GPTModel).

    actor = MegatronActor(sections, groups, model_dir)      # actor/sections.py; loop/build.py from a run config
    old = actor.compute_logprobs(local_batch, micro_batch_size=8, temperature=T)      # no grad
    metrics = actor.train_step(TrainBatch.of_rows(rows, old_logp=..., old_entropy=...))  # one update
    for name, tensor in actor.export_hf_weights(): ...                                  # weight sync
    actor.save_checkpoint(dir, extra_state) / actor.load_checkpoint(dir) / actor.save_hf(dir)

Every method is collective over all ranks. Batches passed in are this DP rank's rows (whole prompt
groups); every rank of one DP replica (its TP x PP ranks) passes the same rows. Results are CPU
tensors, identical on all ranks of the replica; metrics are identical on all ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch

from pacs_megatron.actor import checkpoint as ckpt
from pacs_megatron.actor.forward import forward_logprobs, gather_rows, run_schedule
from pacs_megatron.actor.logit_rows import choose_fused_head, set_fused_head
from pacs_megatron.actor.lora.adapters import adapters_off, sum_replicated_lora_grads
from pacs_megatron.actor.lora.export import gather_peft_tensors, peft_config
from pacs_megatron.actor.lora.reference import LoRAReference
from pacs_megatron.actor.moe.aux_loss import MoeAuxLoss
from pacs_megatron.actor.moe.routing import MoeStats
from pacs_megatron.actor.offload import ActorOffload
from pacs_megatron.actor.optimizer import (
    apply_lr_config,
    build_optimizer,
    build_scheduler,
    clip_and_step,
    reset_optimizer_state,
    use_distributed_optimizer,
    wrap_ddp,
)
from pacs_megatron.actor.policy_model import build_policy_model
from pacs_megatron.actor.reference import ReferencePolicy
from pacs_megatron.actor.sections import ActorSections
from pacs_megatron.actor.thd import use_thd
from pacs_megatron.actor.train_step import (
    FORWARD_KEYS,
    check_train_batch,
    loss_units,
    reduce_metrics,
    step_loss_config,
    train_loss_func,
)
from pacs_megatron.actor.weights import export_hf_weights, save_hf, swapped_hf_weights, unwrap
from pacs_megatron.batch.build import split_micro_batches
from pacs_megatron.batch.packing import pack_micro_batches
from pacs_megatron.batch.rows import Rollouts, TrainBatch, TrainRows
from pacs_megatron.config import ConfigError
from pacs_megatron.hf.spec import model_spec_from_hf
from pacs_megatron.pacs import get_loss, regularize
from pacs_megatron.parallel import ParallelGroups
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class LogprobResult:
    """Log-probs of a batch under the current weights.

    Example:
        >>> r = LogprobResult(torch.zeros(2, 4), torch.zeros(2))
        >>> r.token_logp.shape, r.entropy is None
        (torch.Size([2, 4]), True)
    """

    token_logp: torch.Tensor
    """``[B, T]`` float32: ``log p(input_ids[:, t] | input_ids[:, :t])``; column 0 (and padding) hold
    values of no meaning except column 0 = 0."""
    seq_logp: torch.Tensor
    """``[B]`` float32 sum of token_logp over response tokens."""
    entropy: torch.Tensor | None = None
    """``[B, T]`` float32 entropy of the predictive distribution at t (when asked)."""


def resolve_dtype(name: str, on_gpu: bool) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class MegatronActor:
    """The trainable policy (see module docstring)."""

    reference: ReferencePolicy | LoRAReference | None = None
    """The frozen reference policy of the KL term (algorithm.kl_loss_coef > 0) and of PACS v2's anchor
    (algorithm.pacs.anchor=reference), else None: nothing built."""

    response_logits: bool = True
    """The training forward computes the logits of response tokens only (actor/logit_rows.py): its loss
    reads nothing else. Pass ``response_only=True`` to :meth:`compute_logprobs` for its old log-probs."""

    def __init__(self, sections: ActorSections, groups: ParallelGroups, model_dir: str) -> None:
        """The policy of ``model_dir`` (config.json, and its weights when ``model.loads_weights``) on ``groups``.

        ``sections`` (actor/sections.py): ``model`` its numerics and seed, ``parallel`` sequence parallelism,
        ``actor`` LoRA / routing replay / offloading, ``optimizer`` Adam and the lr schedule, ``train`` the loss,
        batching and the schedule's length."""
        from transformers import AutoConfig

        cfg = self.sections = sections
        self.groups, self.model_dir = groups, str(model_dir)
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.spec = model_spec_from_hf(self.hf_config, groups.tp_size)
        if cfg.actor.routing_replay == "rollout" and cfg.model.recompute_activations:
            raise ConfigError(
                "actor.routing_replay=rollout with model.recompute_activations=true: the recomputed forward "
                "would not replay the same experts; turn one of them off"
            )
        on_gpu = groups.device.type == "cuda"
        self.param_dtype = resolve_dtype(cfg.model.dtype, on_gpu)
        self.distributed_optimizer = use_distributed_optimizer(cfg.optimizer, groups)
        lora = cfg.actor.lora
        # the seeded init, the HF base when model.init loads one, then the adapters on it (actor/policy_model.py)
        self.config, chunks = build_policy_model(
            self.spec,
            groups,
            self.param_dtype,
            seed=cfg.model.seed,
            lora=lora,
            base_dir=self.model_dir if cfg.model.loads_weights else None,
            sequence_parallel=cfg.parallel.sequence_parallel,
            recompute=cfg.model.recompute_activations,
            routing_replay=cfg.actor.routing_replay == "rollout",
        )
        self.model = wrap_ddp(chunks, self.config, cfg.optimizer, groups)
        if lora.enabled:
            sum_replicated_lora_grads(self.config, groups.tp_group)
        vocab_local = self.spec.padded_vocab_size // groups.tp_size
        tokens = cfg.train.micro_batch_tokens  # an upper bound: training computes the response rows only
        self.fused_head = choose_fused_head(cfg.model, tokens, vocab_local, self.param_dtype, groups.device.type)
        """Whether the LM head is fused into the log-prob op (actor/logit_rows.py, ops/head.py); the reference's too."""
        set_fused_head(chunks, self.fused_head)
        self.moe_stats = (
            MoeStats(chunks, self.spec.num_layers, self.spec.num_experts, self.spec.num_experts_per_tok)
            if self.spec.is_moe
            else None
        )
        """Router statistics of each train step (MoE models), logged as moe/*."""
        coeff = cfg.model.moe_aux_loss_coeff
        self.moe_aux = MoeAuxLoss(chunks, coeff, groups) if self.spec.is_moe and coeff > 0 else None
        """The load-balancing loss (actor/moe/aux_loss.py), when model.moe_aux_loss_coeff > 0."""
        self.thd = use_thd(cfg.train.algorithm.dynamic_batching, groups.device, groups.ep_size)
        """THD-packed micro-batches (actor/thd.py; CPU, and GPU with Transformer Engine: unverified there;
        MoE routing replay follows the packing, actor/moe/routing.py)."""
        self.optimizer = build_optimizer(self.model, cfg.optimizer, cfg.model, groups, self.param_dtype)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, cfg.train.optimizer_steps)
        self.iteration = 0
        """Optimizer steps attempted (successful + skipped)."""
        self.skipped_steps = 0
        """Steps skipped for a non-finite gradient norm (the NaN skips below included)."""
        self.nan_skipped_steps = 0
        """Steps skipped because the loss or a metric (log-probs, old log-probs) was NaN/inf."""
        self.offloader = ActorOffload(self.model, self.optimizer, groups.device)
        if cfg.train.algorithm.needs_reference:
            self.reference = LoRAReference(self) if lora.enabled else ReferencePolicy(self)
        if cfg.actor.offload_during_rollout:  # free the (empty) grad buffer before the engine sizes its memory
            self.offload()
        n_params = sum(p.numel() for c in self.model for p in c.parameters())
        self.trainable_params = sum(p.numel() for c in self.model for p in c.parameters() if p.requires_grad)
        """Parameters the optimizer updates on this rank (LoRA: the adapters only)."""
        logger.info(
            "actor: %s, %d layers, %s, %d parameters on rank %d (%d trainable, %.2f%%), %s optimizer",
            self.spec.model_type,
            self.spec.num_layers,
            self.param_dtype,
            n_params,
            groups.rank,
            self.trainable_params,
            100.0 * self.trainable_params / max(n_params, 1),
            "distributed" if self.distributed_optimizer else "plain",
        )

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(
        self,
        batch: Rollouts,
        micro_batch_size: int,
        temperature: float,
        with_entropy: bool = False,
        mini_batch_groups: int = 0,
        response_only: bool = False,
    ) -> LogprobResult:
        """No-grad log-probs of this DP rank's rows, on every rank of the replica (collective).

        With ``algorithm.dynamic_batching`` the rows go in token-budget micro-batches planned per run
        of ``mini_batch_groups`` groups (0: the whole batch), the plan train_step makes for each such
        mini-batch: identical shapes in both passes keep log-probs batch-invariant.
        ``response_only``: log-probs (and entropy) of response tokens only, 0 at prompt tokens: the
        training forward's LM-head shapes (:attr:`response_logits`), so old log-probs for training are
        bit-identical to its own; callers reading prompt tokens (weight-sync probe) keep the default.
        """
        packed = self._packed(batch, mini_batch_groups)
        for c in self.model:
            c.eval()
        try:
            token_logp, entropy = forward_logprobs(
                self.model,
                batch,
                micro_batch_size,
                self.spec,
                self.groups,
                temperature,
                with_entropy,
                packed,
                self.thd,
                response_only and self.response_logits,
            )
        finally:
            for c in self.model:
                c.train()
        seq_logp = (token_logp * batch.response_mask.to(token_logp.dtype)).sum(dim=-1)
        return LogprobResult(token_logp, seq_logp, entropy)

    def compute_ref_logprobs(
        self,
        batch: Rollouts,
        micro_batch_size: int,
        temperature: float,
        mini_batch_groups: int = 0,
        response_only: bool = False,
    ) -> torch.Tensor:
        """No-grad ``[B, T]`` log-probs of the frozen reference policy (algorithm.needs_reference), on the
        micro-batches and LM-head rows of :meth:`compute_logprobs` (collective)."""
        if self.reference is None:
            raise ValueError(
                "compute_ref_logprobs needs a reference policy: set algorithm.kl_loss_coef > 0 or "
                "algorithm.pacs.anchor=reference"
            )
        packed = self._packed(batch, mini_batch_groups)
        only = response_only and self.response_logits
        return self.reference.logprobs(self, batch, micro_batch_size, temperature, packed, self.thd, only)

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch, loss_name: str | None = None) -> dict[str, float]:
        """One optimizer step on this DP rank's share of one mini-batch (collective); metrics are
        reduced over DP and identical on every rank. ``loss_name``: train that registered loss instead of the
        run's (the warm-up's "sft"), without the recipe's KL / entropy terms."""
        return self._train_step(batch, loss_name, old_from_forward=False)[0]

    def train_step_from_forward(self, batch: TrainRows) -> tuple[dict[str, float], LogprobResult]:
        """:meth:`train_step` where pi_theta = pi_old (the first mini-batch after a rollout): the old
        log-probs are the training forward's own, detached, so the rows need none and no separate pass
        is needed. Returns the metrics and those log-probs with their entropy (collective;
        the same on every rank of the replica), bit-identical to :meth:`compute_logprobs` before the step."""
        metrics, result = self._train_step(batch, None, old_from_forward=True)
        assert result is not None
        return metrics, result

    def _train_step(
        self, batch: TrainRows, loss_name: str | None, old_from_forward: bool
    ) -> tuple[dict[str, float], LogprobResult | None]:
        train = self.sections.train
        name = loss_name or train.algorithm.loss
        loss = get_loss(name)
        if loss_name is None:  # the run's RL loss gets the recipe's KL / entropy terms, if any
            a = train.algorithm
            loss = regularize(loss, a.kl_loss_coef, a.kl_loss_type, a.entropy_coeff)
        check_train_batch(batch, old_from_forward)
        mbs = train.algorithm.micro_batch_size
        packed = self._packed(batch, 0)
        micro, rows = packed or (split_micro_batches(batch, min(mbs, len(batch))), torch.arange(len(batch)))
        loss_cfg = step_loss_config(train.algorithm.loss_config(name), train.max_response_length)
        make = partial(
            train_loss_func,
            spec=self.spec,
            groups=self.groups,
            loss=loss,
            loss_cfg=loss_cfg,
            temperature=train.temperature,
            old_from_forward=old_from_forward,
        )
        store: list = []
        if self.moe_aux is not None:  # its scale needs the loss units
            self.moe_aux.begin(micro, loss_units(micro, loss, loss_cfg))
        try:
            metrics = self._update(micro, make, store, response_only=self.response_logits)
        finally:
            if self.moe_aux is not None:
                self.moe_aux.end()
        if not old_from_forward:
            return metrics, None
        token_logp, entropy = gather_rows(micro, rows, store, FORWARD_KEYS, tuple(batch.input_ids.shape), self.groups)
        seq_logp = (token_logp * batch.response_mask.to(token_logp.dtype)).sum(dim=-1)
        return metrics, LogprobResult(token_logp, seq_logp, entropy)

    def _update(
        self, micro: list[TrainRows], make, store_out: list | None = None, response_only: bool = False
    ) -> dict[str, float]:
        """Forward/backward of ``micro`` with megatron loss functions from ``make``, then one optimizer
        step; the DP-reduced metrics of the loss functions plus the step's (shared with the critic).
        ``store_out`` receives what the loss functions reported (last pipeline stage);
        ``response_only``: response tokens' logits only (run_schedule)."""
        self.offloader.restore()  # optimizer state back from the host (actor.offload_during_rollout)
        for c in self.model:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.moe_stats is not None:
            self.moe_stats.start()
        store = run_schedule(
            self.model, micro, make, self.groups, forward_only=False, thd=self.thd, response_only=response_only
        )
        if store_out is not None:
            store_out.extend(store)
        metrics = reduce_metrics(store, self.groups)
        if self.moe_stats is not None:
            metrics.update(self.moe_stats.finish(self.groups, self.spec.moe_layers))
        metrics.update(self._optimizer_step(metrics))
        return metrics

    def _packed(self, batch: Rollouts, chunk_groups: int):
        """Token-budget micro-batches (batch/packing.py) when dynamic batching is on, else None. With
        PP every micro-batch of a pass keeps the rows' padded length only up to its own longest row;
        megatron's p2p then sends shapes ahead (run_schedule), see docs/batching.md."""
        train = self.sections.train
        a = train.algorithm
        if not a.dynamic_batching:
            return None
        return pack_micro_batches(batch, train.micro_batch_tokens, chunk_groups)

    def _optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """Clip and step, or skip the step when the loss / log-prob metrics or the gradient norm are
        not finite (same on all ranks: metrics are reduced over DP and PP, the norm over the model)."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
        if bad:  # NaN log-probs (kernel NaN semantics) or old log-probs: never train on them
            ok, grad_norm = False, float("nan")
            self.nan_skipped_steps += 1
            logger.warning("step %d skipped: non-finite %s", self.iteration + 1, ", ".join(bad))
        else:
            ok, grad_norm = clip_and_step(self.optimizer)
        if ok:
            self.scheduler.step(increment=1)
        else:
            self.skipped_steps += 1
            self.optimizer.zero_grad()
            if not bad:
                logger.warning("step %d skipped: gradient norm %s", self.iteration + 1, grad_norm)
        self.iteration += 1
        return {
            "actor/grad_norm": grad_norm,
            "actor/lr": lr,
            "actor/skipped_steps": float(self.skipped_steps),
            "actor/nan_skipped_steps": float(self.nan_skipped_steps),
        }

    def reset_reference(self) -> None:
        """PACS v2 / ProRL's hard reset (collective-free, every rank on its own shard): the live policy becomes
        the reference and the optimizer starts afresh (Adam's moments and step count re-initialised,
        :func:`reset_optimizer_state`); the lr schedule keeps its position."""
        if self.reference is None:
            raise ValueError("reset_reference needs a reference policy (algorithm.needs_reference)")
        self.reference.copy_from(self)
        self.offloader.restore()  # the state may sit in host memory (actor.offload_during_rollout)
        reset_optimizer_state(self.optimizer)

    def offload(self) -> dict[str, float]:
        """Optimizer state to host, grad buffer freed until the next train step or checkpoint
        (``actor.offload_during_rollout``; the trainer calls it after the update, collective-free)."""
        return self.offloader.offload() if self.sections.actor.offload_during_rollout else {}

    # ------------------------------------------------------------------ weights and checkpoints

    def export_hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time, same order on every rank (collective)."""
        return export_hf_weights(self.model, self.spec, self.groups, dtype)

    def export_base_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`export_hf_weights` with every LoRA adapter off: the frozen base (the adapter-only sync's)."""
        with adapters_off([unwrap(c) for c in self.model]):
            yield from export_hf_weights(self.model, self.spec, self.groups)

    def peft_adapter(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Every stage's LoRA adapters as PEFT-named full CPU tensors on every rank, with their
        ``adapter_config.json`` (collective over TP and PP; actor/lora/export.py): the adapter-only sync's."""
        tensors = gather_peft_tensors(self.model, self.spec, self.groups)
        return tensors, peft_config(tensors, self.sections.actor.lora, self.model_dir)

    def swapped_hf_weights(self, tensors: dict[str, torch.Tensor]):
        """Context manager: hold these full HF-named tensors instead of the trained ones (restored on exit)."""
        return swapped_hf_weights(self.model, self.spec, self.groups, tensors)

    def save_hf(self, path: str) -> None:
        """config.json + safetensors (+ tokenizer files of model_dir), written by rank 0 (collective)."""
        save_hf(self.model, self.spec, self.groups, self.hf_config, path, self.model_dir)

    def save_checkpoint(self, path: str, extra_state: dict) -> None:
        """Model, optimizer, LR scheduler, RNG and counters via dist_checkpointing (collective)."""
        was_offloaded = self.offloader.offloaded
        self.offloader.restore()
        ckpt.save_actor_checkpoint(self, path, extra_state)
        if self.reference is not None:
            self.reference.save(self, path)
        if was_offloaded:  # a save between update and rollout: keep the rollout's memory free
            self.offloader.offload()

    def load_checkpoint(self, path: str) -> dict:
        """Restore a checkpoint written at any TP/PP layout; returns the saved extra_state (collective)."""
        self.offloader.restore()
        extra = ckpt.load_actor_checkpoint(self, path)
        if self.reference is not None:
            self.reference.load(path)
        apply_lr_config(self.optimizer, self.scheduler, self.sections.optimizer)  # a changed lr applies on resume
        return extra
