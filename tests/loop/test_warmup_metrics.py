"""The supervised warm-up names its max metric for what it measures (issue 58): with zero old log-probs the
train step's ``actor/max_abs_logratio`` is the largest NLL of one demonstration token."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.loop.warmup import _sft_step


class _Actor:
    def __init__(self) -> None:
        self.batch = None

    def train_step(self, batch, loss_name=None):
        self.batch, self.loss_name = batch, loss_name
        logp = -torch.tensor([[0.0, 0.5, 8.3, 0.1]])  # what a train step reports: max |logp - old| over the mask
        return {"sft/loss": 1.0, "actor/max_abs_logratio": float((logp - batch.old_logp[:1, :4]).abs().max())}


def test_sft_step_reports_the_worst_token_nll():
    actor = _Actor()
    shard = build_rollouts([[1, 2]], [[3, 4]], [0.0], 1, pad_id=0)
    metrics = _sft_step(SimpleNamespace(actor=actor), shard)
    assert actor.loss_name == "sft" and bool((actor.batch.old_logp == 0).all())
    assert "actor/max_abs_logratio" not in metrics
    assert abs(metrics["sft/max_token_nll"] - 8.3) < 1e-6 and metrics["sft/loss"] == 1.0
