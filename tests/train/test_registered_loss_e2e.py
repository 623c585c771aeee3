"""A loss added by registration alone trains the CPU default (issue 60 item 3): a toy REINFORCE, registered in
each rank with its traits and nothing else edited, trains one RL step of the tests/_runs.py SHORT run, in-process
on two gloo ranks (TP=2, the CPU default's layout): its outcome advantages come from its traits, its metric
reaches metrics.jsonl, and no PACS metric or hook runs."""

from __future__ import annotations

import math

import pytest
import torch
from _dist import run_distributed
from _runs import CONFIG, SHORT, metrics_rows


def _toy_reinforce(b, logp: torch.Tensor, cfg, entropy=None):
    """REINFORCE: -A_i times the row's mean token log-prob, a mean over rows (unit "row")."""
    m = b.response_mask.to(logp.dtype)
    per_row = (logp * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    loss = -(b.advantages.to(logp.dtype) * per_row).mean()
    return loss, {"toy/loss": loss.detach()}


def _train_with_toy(rank: int, world_size: int, out: str) -> int:
    from pacs_megatron.config import load_config
    from pacs_megatron.launch.dtype import resolve_model_dtype
    from pacs_megatron.loop.train import train
    from pacs_megatron.pacs import LossTraits, outcome_advantages, register_loss

    traits = LossTraits(section="policy", outcome_advantages=outcome_advantages)  # GRPO's advantages, token IS
    register_loss("toy_reinforce", unit="row", traits=traits)(_toy_reinforce)
    overrides = [f"trainer.output_dir={out}", f"model.path={out}/model", "trainer.total_steps=1", *SHORT]
    cfg = load_config(CONFIG, [*overrides, "algorithm.loss=toy_reinforce"])
    resolve_model_dtype(cfg, log=False)  # what the command line does before it trains
    return train(cfg)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_loss_registered_alone_trains_a_cpu_default_step(tmp_path):
    assert run_distributed(_train_with_toy, 2, str(tmp_path)) == [0, 0]
    row = metrics_rows(tmp_path)[1]
    assert math.isfinite(row["toy/loss"]) and row["toy/loss"] != 0.0  # the step's mixed groups give A != 0
    assert row["actor/grad_norm"] > 0 and row["actor/updates"] == 1.0
    assert "pacs/loss" not in row and not [k for k in row if k.startswith("pacs/post_")]  # no PACS loss, no hook
