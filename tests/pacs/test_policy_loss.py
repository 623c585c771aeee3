"""GRPO / PPO-clip surrogate and the loss registry, against hand computations."""

import math
from dataclasses import fields

import pytest
import torch

from pacs_megatron.batch.rows import TrainBatch, loss_batch
from pacs_megatron.config import AlgorithmConfig
from pacs_megatron.pacs import LOSSES, PolicyLossConfig, clipped_policy_loss, get_loss, outcome_advantages


def _expected(logp, old, mask, adv, lo, hi, mode):
    per_row, tok_sum, tok_cnt = [], 0.0, 0
    for i in range(len(logp)):
        vals = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            vals.append(max(-adv[i] * ratio, -adv[i] * min(max(ratio, 1 - lo), 1 + hi)))
        per_row.append(vals)
        tok_sum += sum(vals)
        tok_cnt += len(vals)
    if mode == "token-mean":
        return tok_sum / tok_cnt
    if mode == "seq-mean-token-sum":
        return sum(sum(v) for v in per_row) / len(per_row)
    return sum(sum(v) / len(v) for v in per_row) / len(per_row)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_clipped_loss_matches_hand_computation(mode):
    logp = [[0.0, -0.1, -1.0, -0.3], [0.0, -0.2, -0.9, 0.0]]
    old = [[0.0, -0.5, -0.6, -0.3], [0.0, -0.1, -1.2, 0.0]]
    mask = [[0, 1, 1, 1], [0, 1, 1, 0]]
    adv = [1.5, -0.7]
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode, adv_estimator="grpo")
    loss, m = clipped_policy_loss(
        torch.tensor(logp, dtype=torch.float64),
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.bool),
        torch.tensor(adv, dtype=torch.float64),
        cfg,
    )
    assert loss.item() == pytest.approx(_expected(logp, old, mask, adv, 0.2, 0.28, mode), rel=1e-12)
    assert 0 < m["policy/clipfrac"].item() < 1


def test_outcome_advantages():
    cfg = PolicyLossConfig(adv_estimator="grpo")
    a = outcome_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, cfg)
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)
    assert a.tolist() == pytest.approx([0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3)
    with pytest.raises(ValueError, match="auto"):
        outcome_advantages(torch.ones(4), 4, PolicyLossConfig())


def test_registry_and_loss_config_resolution():
    assert set(LOSSES) >= {"pacs", "grpo", "ppo"}
    assert AlgorithmConfig(loss="ppo").loss_config().adv_estimator == "rloo"
    assert AlgorithmConfig(loss="grpo").loss_config().adv_estimator == "grpo"
    with pytest.raises(ValueError, match="not registered"):
        get_loss("dpo")
    x = loss_batch(torch.zeros(2, 3), torch.tensor([[0, 1, 1], [0, 1, 0]]), torch.ones(2), 2)
    spec = get_loss("grpo")
    assert spec.traits.outcome_advantages is not None and spec.traits.gae
    # A TrainBatch cannot exist without advantages (no None sentinel for the loss to reject any more).
    with pytest.raises(TypeError, match="advantages"):
        TrainBatch(**{f.name: getattr(x, f.name) for f in fields(TrainBatch) if f.name != "advantages"})
    assert spec.denominator(x, PolicyLossConfig(loss_agg_mode="token-mean")).item() == 3
    assert spec.denominator(x, PolicyLossConfig(loss_agg_mode="seq-mean-token-sum")).item() == 2


def test_micro_batch_weighting_reproduces_full_batch():
    """Weighting each micro-batch's mean by denominator/total gives the full batch's loss exactly."""
    torch.manual_seed(0)
    B, T, n = 8, 6, 2
    logp = torch.randn(B, T, dtype=torch.float64)
    x = loss_batch(
        torch.randn(B, T, dtype=torch.float64),
        torch.rand(B, T) > 0.4,
        torch.tensor([1.0, 0, 1, 1, 0, 0, 1, 0]),
        n,
        advantages=torch.randn(B, dtype=torch.float64),
    )
    for name, cfg in [("pacs", AlgorithmConfig().loss_config()), ("grpo", PolicyLossConfig(adv_estimator="grpo"))]:
        spec = get_loss(name)
        full, _ = spec.fn(x, logp, cfg)
        total = spec.denominator(x, cfg)
        acc = 0.0
        for s in range(0, B, 4):
            part = x.rows(s, s + 4)
            loss, _ = spec.fn(part, logp[s : s + 4], cfg)
            acc += loss * spec.denominator(part, cfg) / total
        assert acc.item() == pytest.approx(full.item(), rel=1e-12)


def test_sft_loss_is_token_mean_nll():
    logp = torch.tensor([[0.0, -1.0, -3.0], [0.0, -2.0, -5.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    x = loss_batch(torch.zeros_like(logp), mask, torch.zeros(2), 1)
    spec = get_loss("sft")
    loss, m = spec.fn(x, logp, None)
    assert loss.item() == pytest.approx((1 + 3 + 2) / 3)
    assert spec.denominator(x, None).item() == 3
