"""The loss side of one optimizer step: megatron's ``loss_func`` for a registered loss, and the
reduction of its metrics.

Gradient convention (one rule, exact): a registered loss returns a *mean* over its unit (rows or
response tokens) and ``LossSpec.denominator`` counts those units. For micro-batch i on DP rank d,
``loss_func`` returns megatron's 3-tuple

    (mean_i * n_i,  n_i,  metrics)         n_i = denominator of the micro-batch (an integer count)

and the model config has ``calculate_per_token_loss=True``, so megatron (a) does not divide by the
number of micro-batches, (b) sums (not averages) gradients over DP in its DDP buffers, and
(c) divides the final gradients by N = sum_{i,d} n_i (``finalize_model_grads``, after broadcasting
n from the last stage and all-reducing over DP). The update therefore follows

    grad( sum_{i,d} n_i * mean_i / N )  =  grad( mini-batch loss computed on one process ),

for any micro-batch size and DP size. Metrics are combined with the same weights n_i / N, except
``actor/max_abs_logratio`` (a max). Context parallelism: every CP rank computes the same loss from the
gathered log-probs (actor/forward.py), megatron's DDP sums the CP ranks' gradients (each reaches its own
tokens), and only CP rank 0 returns n_i, so N counts every unit once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from pacs_megatron.actor.forward import token_logprobs
from pacs_megatron.actor.logit_rows import LogitRows
from pacs_megatron.actor.thd import ThdBatch
from pacs_megatron.batch.rows import TrainBatch, TrainRows
from pacs_megatron.hf.spec import ModelSpec
from pacs_megatron.pacs import LossSpec
from pacs_megatron.parallel import ParallelGroups

_DENOM = "_denominator"
_MAXLR = "actor/max_abs_logratio"
FORWARD_KEYS = ("_token_logp", "_entropy")
"""What a loss function with ``old_from_forward`` reports besides metrics: its forward's ``[b, T]`` log-probs
and entropy (detached), the old log-probs of its rows (private keys: never reduced as metrics)."""


def check_train_batch(batch: TrainRows, old_from_forward: bool) -> None:
    """A mini-batch trains from its own forward's log-probs (TrainRows, the step's first) or from pi_old's
    given ones (TrainBatch): the types say which, and a wrong pairing fails here, before any forward."""
    if not old_from_forward and not isinstance(batch, TrainBatch):
        raise TypeError(
            f"train_step needs a TrainBatch (pi_old's log-probs filled), got {type(batch).__name__}: build it with "
            "TrainBatch.of_rows(rows, old_logp=..., old_entropy=...), or train it with train_step_from_forward"
        )


def step_loss_config(loss_cfg: Any, max_response_length: int) -> Any:
    """``loss_cfg`` with ``seq-mean-token-sum-norm``'s horizon fixed to ``rollout.max_response_length``
    when the config leaves it at 0, as verl's fixed response length. ``aggregate`` would otherwise
    divide each micro-batch by its own width (token-budget micro-batches, batch/packing.py, are cut to
    their longest row), and even the step's padded prompt + response width changes from step to step:
    the loss scale would follow the batch's longest row."""
    if getattr(loss_cfg, "loss_agg_mode", None) == "seq-mean-token-sum-norm" and not loss_cfg.loss_agg_horizon:
        return replace(loss_cfg, loss_agg_horizon=max_response_length)
    return loss_cfg


def loss_units(micro: list[TrainRows], loss: LossSpec, loss_cfg: Any) -> float:
    """The sum of the unit counts the loss functions of ``micro`` will return (``LossSpec.denominator``
    reads the masks only, known before the forward): what ``finalize_model_grads`` divides the gradients
    by on this rank."""
    return sum(float(loss.denominator(mb, loss_cfg).round()) for mb in micro)


def train_loss_func(
    mb: TrainRows,
    ids: torch.Tensor,
    dummy: bool,
    spec: ModelSpec,
    groups: ParallelGroups,
    loss: LossSpec,
    loss_cfg: Any,
    temperature: float,
    old_from_forward: bool = False,
    thd: ThdBatch | None = None,
    rows: LogitRows | None = None,
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    """megatron ``loss_func`` of one micro-batch (runs on the last pipeline stage). A ``dummy``
    (padding) micro-batch returns a zero loss and a zero count: no gradient, no weight.

    ``old_from_forward`` (pi_theta = pi_old, the first mini-batch of a step, given as :class:`TrainRows`):
    the old log-probs are this forward's own, detached, bit-identical to what the no-grad pass gives (same
    kernel, same micro-batch); they and the entropy are reported under :data:`FORWARD_KEYS`."""

    def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        token_logp, entropy = token_logprobs(
            logits,
            ids,
            spec,
            groups,
            temperature,
            with_entropy=old_from_forward or loss.needs_entropy,
            inplace_backward=True,
            thd=thd,
            rows=rows,
        )
        dev = token_logp.device
        if old_from_forward:  # the forward asked for the entropy (with_entropy above)
            assert entropy is not None
            batch = TrainBatch.of_rows(mb.to(dev), old_logp=token_logp.detach(), old_entropy=entropy.detach())
        else:
            assert isinstance(mb, TrainBatch)  # check_train_batch said so
            batch = mb.to(dev)
        mask, old = batch.response_mask, batch.old_logp
        value, metrics = loss.fn(batch, token_logp, loss_cfg, entropy)
        denom = loss.denominator(batch, loss_cfg)
        if dummy:
            denom = torch.zeros_like(denom)
        with torch.no_grad():
            ratio = ((token_logp - old).abs() * mask).amax() if bool(mask.any()) else token_logp.new_zeros(())
            reported = {k: torch.as_tensor(v).detach().double().reshape(()) for k, v in metrics.items()}
            reported[_DENOM] = denom.detach().double().reshape(())
            reported[_MAXLR] = ratio.double()
            if old_from_forward:
                reported.update(zip(FORWARD_KEYS, (token_logp.detach(), batch.old_entropy)))
        n = denom.detach().round().to(torch.int).to(dev)
        if groups.cp_rank > 0:  # the CP group shares one loss: rank 0 counts its units (module docstring)
            n = torch.zeros_like(n)
        return value * denom.to(value.dtype), n, reported

    return loss_func


def reduce_metrics(store: list[dict], groups: ParallelGroups) -> dict[str, float]:
    """Combine the micro-batches' metrics over this rank's store and DP, then share them over PP.

    Mean-like metrics are weighted by the micro-batches' denominators; the log-ratio is a max.
    """
    out: dict[str, float] | None = None
    if groups.is_last_stage:
        keys = sorted(k for k in store[0] if k != _MAXLR and not k.startswith("_"))
        den = torch.stack([d[_DENOM] for d in store]).cpu()
        vals = torch.stack([torch.stack([d[k] for k in keys]) for d in store]).cpu() if keys else None
        sums = torch.cat(
            [(vals * den[:, None]).sum(0) if keys else torch.zeros(0, dtype=torch.float64), den.sum()[None]]
        )
        mx = torch.stack([d[_MAXLR] for d in store]).max().cpu().reshape(1)
        if groups.dp_size > 1:
            sums, mx = sums.to(groups.device), mx.to(groups.device)
            dist.all_reduce(sums, group=groups.dp_group)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=groups.dp_group)
            sums, mx = sums.cpu(), mx.cpu()
        total = float(sums[-1])
        out = {k: float(sums[i]) / total if total > 0 else 0.0 for i, k in enumerate(keys)}
        out[_MAXLR] = float(mx[0])
    if groups.pp_size > 1:
        box = [out]
        dist.broadcast_object_list(box, src=groups.pp_last_rank, group=groups.pp_group)
        out = box[0]
    assert out is not None  # the last stage computed it; PP broadcast it to the others
    return out
