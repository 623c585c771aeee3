"""MegatronActor: the policy the trainer and weight sync talk to (TP x PP x DP megatron-core GPTModel).

    actor = MegatronActor(cfg, groups, model_dir)
    old = actor.compute_logprobs(local_batch, micro_batch_size=8, temperature=T)      # no grad
    metrics = actor.train_step(mini_batch.with_(old_logp=...))                         # one update
    for name, tensor in actor.export_hf_weights(): ...                                  # weight sync
    actor.save_checkpoint(dir, extra_state) / actor.load_checkpoint(dir) / actor.save_hf(dir)

Every method is collective over all ranks. Batches passed in are this DP rank's rows (whole prompt
groups); every rank of one DP replica (its TP x PP ranks) passes the same rows. Results are CPU
tensors, identical on all ranks of the replica; metrics are identical on all ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial

import torch

from pacs_megatron.actor import checkpoint as ckpt
from pacs_megatron.actor.forward import forward_logprobs, run_schedule
from pacs_megatron.actor.model import build_model_chunks, model_spec_from_hf, transformer_config
from pacs_megatron.actor.optimizer import build_optimizer, build_scheduler, use_distributed_optimizer, wrap_ddp
from pacs_megatron.actor.train_step import check_train_batch, reduce_metrics, train_loss_func
from pacs_megatron.actor.weights import export_hf_weights, load_hf_weights, save_hf
from pacs_megatron.config import RunConfig
from pacs_megatron.data.batching import TrainBatch, split_micro_batches
from pacs_megatron.pacs import get_loss
from pacs_megatron.parallel import ParallelGroups
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

_BUILTIN_LOSSES = ("pacs", "grpo", "ppo")


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


def _seed_for_init(seed: int, on_gpu: bool) -> None:
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:  # model_parallel_cuda_manual_seed needs CUDA; CPU init draws from torch's default generator
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


class MegatronActor:
    """The trainable policy (see module docstring)."""

    def __init__(self, cfg: RunConfig, groups: ParallelGroups, model_dir: str) -> None:
        from transformers import AutoConfig

        self.cfg, self.groups, self.model_dir = cfg, groups, str(model_dir)
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.spec = model_spec_from_hf(self.hf_config, groups.tp_size)
        on_gpu = groups.device.type == "cuda"
        self.param_dtype = resolve_dtype(cfg.model.dtype, on_gpu)
        self.distributed_optimizer = use_distributed_optimizer(cfg, groups)
        self.config = transformer_config(
            self.spec, groups, self.param_dtype, cfg.parallel.sequence_parallel, cfg.model.recompute_activations
        )
        # A fixed seed for initialisation only; the caller's RNG streams are left as they were.
        with torch.random.fork_rng(devices=[groups.device] if on_gpu else []):
            _seed_for_init(cfg.model.seed, on_gpu)
            chunks = build_model_chunks(self.spec, self.config, groups)
        if cfg.model.init == "pretrained":
            load_hf_weights(chunks, self.spec, self.model_dir, groups)
        self.model = wrap_ddp(chunks, self.config, cfg, groups)
        self.optimizer = build_optimizer(self.model, cfg, groups, self.param_dtype)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.iteration = 0
        """Optimizer steps attempted (successful + skipped)."""
        self.skipped_steps = 0
        """Steps skipped for a non-finite gradient norm."""
        n_params = sum(p.numel() for c in self.model for p in c.parameters())
        logger.info(
            "actor: %s, %d layers, %s, %d parameters on rank %d, %s optimizer",
            self.spec.model_type,
            self.spec.num_layers,
            self.param_dtype,
            n_params,
            groups.rank,
            "distributed" if self.distributed_optimizer else "plain",
        )

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(
        self, batch: TrainBatch, micro_batch_size: int, temperature: float, with_entropy: bool = False
    ) -> LogprobResult:
        """No-grad log-probs of this DP rank's rows, on every rank of the replica (collective)."""
        for c in self.model:
            c.eval()
        try:
            token_logp, entropy = forward_logprobs(
                self.model, batch, micro_batch_size, self.spec, self.groups, temperature, with_entropy
            )
        finally:
            for c in self.model:
                c.train()
        seq_logp = (token_logp * batch.response_mask.to(token_logp.dtype)).sum(dim=-1)
        return LogprobResult(token_logp, seq_logp, entropy)

    # ------------------------------------------------------------------ training

    def _loss_config(self, name: str):
        algo = self.cfg.algorithm
        if name != algo.loss and name in _BUILTIN_LOSSES:
            return replace(algo, loss=name).loss_config()
        return algo.loss_config()  # other registered losses (e.g. "sft") read what they need

    def train_step(self, batch: TrainBatch, loss_name: str | None = None) -> dict[str, float]:
        """One optimizer step on this DP rank's share of one mini-batch (collective); metrics are
        reduced over DP and identical on every rank."""
        name = loss_name or self.cfg.algorithm.loss
        loss = get_loss(name)
        check_train_batch(batch, loss, name)
        mbs = self.cfg.algorithm.micro_batch_size
        micro = split_micro_batches(batch, min(mbs, len(batch)))
        make = partial(
            train_loss_func,
            spec=self.spec,
            groups=self.groups,
            loss=loss,
            loss_cfg=self._loss_config(name),
            temperature=self.cfg.rollout.temperature,
        )
        return self._update(micro, make)

    def _update(self, micro: list[TrainBatch], make) -> dict[str, float]:
        """Forward/backward of ``micro`` with megatron loss functions from ``make``, then one optimizer
        step; the DP-reduced metrics of the loss functions plus the step's (shared with the critic)."""
        for c in self.model:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        store = run_schedule(self.model, micro, make, self.groups, forward_only=False)
        metrics = reduce_metrics(store, self.groups)
        metrics.update(self._optimizer_step())
        return metrics

    def _optimizer_step(self) -> dict[str, float]:
        """Clip and step, or skip the step when the gradient norm is not finite (same on all ranks:
        the norm is reduced over the whole model and the grads are already DP-reduced)."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        ok = math.isfinite(grad_norm)
        if ok:
            ok, _, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        else:
            self.skipped_steps += 1
            self.optimizer.zero_grad()
            logger.warning("optimizer step skipped: gradient norm %s", grad_norm)
        self.iteration += 1
        return {"actor/grad_norm": grad_norm, "actor/lr": lr, "actor/skipped_steps": float(self.skipped_steps)}

    # ------------------------------------------------------------------ weights and checkpoints

    def export_hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time, same order on every rank (collective)."""
        return export_hf_weights(self.model, self.spec, self.groups, dtype)

    def save_hf(self, path: str) -> None:
        """config.json + safetensors (+ tokenizer files of model_dir), written by rank 0 (collective)."""
        save_hf(self.model, self.spec, self.groups, self.hf_config, path, self.model_dir)

    def save_checkpoint(self, path: str, extra_state: dict) -> None:
        """Model, optimizer, LR scheduler, RNG and counters via dist_checkpointing (collective)."""
        ckpt.save_actor_checkpoint(self, path, extra_state)

    def load_checkpoint(self, path: str) -> dict:
        """Restore a checkpoint written at any TP/PP layout; returns the saved extra_state (collective)."""
        return ckpt.load_actor_checkpoint(self, path)
