"""MegatronCritic: the learned value function of the paper's PPO baseline (GAE advantages).

    critic = MegatronCritic(cfg.critic, groups, actor)   # loop/build.py build_critic: None unless adv_estimator=gae
    values = critic.compute_values(local_batch, micro_batch_size=8)        # [B, T], no grad
    metrics = critic.train_step(mini_batch)   # needs old_values and returns; one optimizer step

Design: the actor's machinery, not a copy of it. The critic is a :class:`MegatronActor` subclass
built by the same functions (``build_policy_model``, ``wrap_ddp``, ``build_optimizer``,
``build_scheduler``) with its own TransformerConfig, optimizer and schedule (``critic.optim``), on
the actor's process groups and sections (same TP/PP/DP layout, colocated). Only the last pipeline stage
differs: the vocab-parallel output layer is replaced by :class:`ValueHead`, a replicated ``[1, H]``
projection. Hidden states are replicated over TP, so the head's output already is the same on
every TP rank; with sequence parallelism the head runs on the rank's sequence shard and the values
are gathered over TP (the head's gradient is then summed over TP by megatron's
``finalize_model_grads``, through the ``sequence_parallel`` attribute, like a LayerNorm weight).

Forward passes reuse actor/forward.py's ``run_schedule`` with critic loss functions, and
checkpoints reuse actor/checkpoint.py (the critic is saved in its own sub-directory).
``values[:, t]`` is the value of the prefix ``input_ids[:, :t]`` (the state before token t), aligned
with ``token_logp[:, t]``; column 0 holds 0.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pacs_megatron.actor.actor import MegatronActor
from pacs_megatron.actor.forward import run_schedule
from pacs_megatron.actor.offload import ActorOffload
from pacs_megatron.actor.optimizer import build_optimizer, build_scheduler, use_distributed_optimizer, wrap_ddp
from pacs_megatron.actor.policy_model import build_policy_model
from pacs_megatron.actor.train_step import _DENOM, _MAXLR
from pacs_megatron.actor.weights import unwrap
from pacs_megatron.batch.build import split_micro_batches
from pacs_megatron.batch.rows import Rollouts, TrainRows
from pacs_megatron.config import CriticConfig, critic_loss_agg
from pacs_megatron.config.model import check_context_parallel
from pacs_megatron.pacs import value_loss
from pacs_megatron.parallel import ParallelGroups
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class ValueHead(torch.nn.Module):
    """Scalar projection ``V = w . h + b`` standing in for GPTModel's output layer (same call signature).

    verl's value head is ``nn.Linear(H, 1)`` (a token-classification head: weight and bias); so is
    this one. Both are zero-initialised where verl draws the weight from N(0, 0.02): the first values
    are exactly 0 (a known starting point, the same on every layout), the first critic step moves only
    the head, and the bias learns the mean return without touching the trunk.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool, tp_group) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group
        # Summed over TP by finalize_model_grads when each rank saw only its sequence shard.
        self.weight.sequence_parallel = sequence_parallel
        self.bias.sequence_parallel = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):  # noqa: ARG002 - GPTModel's call
        values = F.linear(hidden, self.weight, self.bias)  # [s(/tp), b, 1]
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Every TP rank computes the same loss on the gathered values: the backward is a split.
            values = gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return values, None


def aligned_values(out: torch.Tensor) -> torch.Tensor:
    """``[b, T]`` float32 values from the model's ``[b, T, 1]`` output: position t-1's head output
    goes to column t (the value of the state before token t); column 0 is 0."""
    return F.pad(out[:, :-1, 0].float(), (1, 0))


class MegatronCritic(MegatronActor):
    """Value model on the actor's layout (see module docstring). Every method is collective."""

    def __init__(self, critic: CriticConfig, groups: ParallelGroups, actor: MegatronActor) -> None:
        """The value model of ``actor`` on ``groups``: ``critic`` its init, optimizer (``critic.optim``), value
        clip, micro-batch size and loss aggregation; the rest (model numerics, parallelism, the loss's batching
        and the schedule's length) are the actor's sections."""
        # The critic's optimizer and schedule, built by the actor's code from the actor's sections whose
        # ``optimizer`` is ``critic.optim``.
        cfg = self.sections = replace(actor.sections, optimizer=critic.optim)
        # the config's line (config/model.py), for a caller that builds a critic without the config's checks
        check_context_parallel(cfg.parallel, critic=True, routing_replay="none")
        self.critic_cfg, self.groups, self.model_dir = critic, groups, actor.model_dir
        self.hf_config, self.param_dtype = actor.hf_config, actor.param_dtype
        # Untied: the critic has no LM head to share the embedding with.
        self.spec = replace(actor.spec, tie_embeddings=False)
        self.distributed_optimizer = use_distributed_optimizer(cfg.optimizer, groups)
        self.config, chunks = build_policy_model(
            self.spec,
            groups,
            self.param_dtype,
            seed=cfg.model.seed,
            sequence_parallel=cfg.parallel.sequence_parallel,
            recompute=cfg.model.recompute_activations,
        )
        for chunk in chunks:
            model = unwrap(chunk)
            if model.post_process:
                model.output_layer = ValueHead(
                    self.spec.hidden_size, self.param_dtype, cfg.parallel.sequence_parallel, groups.tp_group
                ).to(groups.device)
        if critic.init == "actor":
            _copy_trunk(actor.model, chunks)
        else:
            _load_trunk_from_hf(chunks, self.spec, critic.init, groups)
        self.model = wrap_ddp(chunks, self.config, cfg.optimizer, groups)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, cfg.model, groups, self.param_dtype)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, cfg.train.optimizer_steps)
        self.iteration = 0
        self.skipped_steps = 0
        self.nan_skipped_steps = 0
        self.thd = False  # the critic's own passes use padded micro-batches
        self.moe_stats = None  # router statistics are logged for the policy only (moe/*)
        self.offloader = ActorOffload(self.model, self.optimizer, groups.device)
        logger.info("critic: value head, init from %s, lr %g", critic.init, critic.optim.lr)

    @property
    def micro_batch_size(self) -> int:
        return self.critic_cfg.micro_batch_size or self.sections.train.algorithm.micro_batch_size

    def compute_values(self, batch: Rollouts, micro_batch_size: int | None = None) -> torch.Tensor:
        """No-grad ``[B, T]`` float32 values of this DP rank's rows, on every rank of the replica."""
        B, T = batch.input_ids.shape
        micro = split_micro_batches(batch, min(micro_batch_size or self.micro_batch_size, B))

        def make(mb, ids, dummy):  # noqa: ARG001 - run_schedule's loss-function factory
            return lambda out, non_loss_data=False: {"values": aligned_values(out)}

        for c in self.model:
            c.eval()
        try:
            with torch.no_grad():
                store = run_schedule(self.model, micro, make, self.groups, forward_only=True)
        finally:
            for c in self.model:
                c.train()
        buf = torch.empty((B, T), dtype=torch.float32, device=self.groups.device)
        if self.groups.is_last_stage:
            buf.copy_(torch.cat([d["values"] for d in store]))
        if self.groups.pp_size > 1:
            dist.broadcast(buf, src=self.groups.pp_last_rank, group=self.groups.pp_group)
        return buf.cpu()

    def train_step(self, batch: TrainRows, loss_name: str | None = None) -> dict[str, float]:  # noqa: ARG002
        """One critic optimizer step on this DP rank's share of a mini-batch (clipped value loss)."""
        if batch.old_values is None or batch.returns is None:
            raise ValueError("critic.train_step needs batch.old_values and batch.returns (GAE)")
        micro = split_micro_batches(batch, min(self.micro_batch_size, len(batch)))
        train = self.sections.train
        mode, horizon = critic_loss_agg(self.critic_cfg, train.algorithm, train.max_response_length)
        loss = partial(_value_loss_func, clip=self.critic_cfg.cliprange_value, mode=mode, horizon=horizon)
        metrics = self._update(micro, loss)
        metrics.pop(_MAXLR, None)
        return {k.replace("actor/", "critic/"): v for k, v in metrics.items()}

    @torch.no_grad()
    def copy_trunk_from(self, actor: MegatronActor) -> None:
        """Copy the actor's current trunk into the critic (the head is kept) and refresh the
        optimizer's main parameters (bf16 / distributed optimizer keep fp32 copies)."""
        _copy_trunk(actor.model, self.model)
        self.optimizer.reload_model_params()


def _value_loss_func(mb: TrainRows, ids: torch.Tensor, dummy: bool, clip: float, mode: str, horizon: int):  # noqa: ARG001
    """megatron ``loss_func`` of one critic micro-batch: the value loss aggregated by ``mode`` (a mean
    over tokens or rows) times that unit count (the train step's gradient convention, see
    train_step.py); a padding micro-batch counts 0."""

    def loss_func(out):
        values = aligned_values(out)
        dev = values.device
        mask = mb.response_mask.to(dev)
        assert mb.returns is not None and mb.old_values is not None  # checked by MegatronCritic.train_step
        loss, clipfrac = value_loss(values, mb.returns.to(dev), mb.old_values.to(dev), mask, clip, mode, horizon)
        units = mask.sum() if mode == "token-mean" else torch.tensor(float(len(mb)), device=dev)
        n = units.to(torch.float64) * (0.0 if dummy else 1.0)
        reported = {
            "critic/value_loss": loss.detach().double(),
            "critic/vf_clipfrac": clipfrac.double(),
            "critic/vpred_mean": ((values.detach() * mask).sum() / mask.sum().clamp(min=1)).double(),
            _DENOM: n,
            _MAXLR: torch.zeros((), dtype=torch.float64),
        }
        return loss * n.to(loss.dtype), n.round().to(torch.int).to(dev), reported

    return loss_func


@torch.no_grad()
def _copy_trunk(actor_chunks: list, critic_chunks: list) -> None:
    """Copy every actor parameter the critic has (all but the LM head) into the critic."""
    n = 0
    for a, c in zip(actor_chunks, critic_chunks):
        src = dict(unwrap(a).named_parameters())
        for name, p in unwrap(c).named_parameters():
            if name.startswith("output_layer."):
                continue
            p.copy_(src[name])
            n += 1
    logger.info("critic: copied %d parameter tensors per rank from the actor", n)


def _load_trunk_from_hf(chunks: list, spec, path: str, groups: ParallelGroups) -> None:
    """Load embedding, layers and final norm from an HF directory (the value head stays zero)."""
    from pacs_megatron.hf.convert import load_chunk_from_hf
    from pacs_megatron.hf.io import SafetensorsReader

    reader = SafetensorsReader(path)
    try:
        for chunk in chunks:
            model = unwrap(chunk)
            head = model._modules.pop("output_layer", None)  # hidden from the HF name mapping
            try:
                load_chunk_from_hf(model, spec, reader.get, groups.tp_rank, groups.tp_size)
            finally:
                if head is not None:
                    model.output_layer = head
    finally:
        reader.close()
