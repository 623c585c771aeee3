"""Rollout correction on a hand-built batch: the TIS / MIS weights, the mismatch metrics (NaN stays NaN),
and how the weights enter the GRPO/PPO surrogate and the PACS BCE; every expectation is computed here
independently (python floats and math.exp)."""

from __future__ import annotations

import math

import pytest
import torch

from pacs_megatron.batch.rows import TrainBatch, loss_batch
from pacs_megatron.config import ConfigError, load_config
from pacs_megatron.pacs import LOSSES, PACSConfig, PolicyLossConfig
from pacs_megatron.pacs.rollout_correction import importance_weights, mismatch_metrics

# 4 rows (2 groups of 2), T = 5; position 0 is a prompt token, response tokens where MASK is 1.
MASK = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 1, 1, 0, 0]], dtype=torch.bool)
OLD = torch.tensor(
    [
        [0.0, -0.5, -1.0, -0.2, 9.0],
        [0.0, -3.0, -0.1, -2.0, -0.3],
        [0.0, -0.7, 5.0, 5.0, 5.0],
        [0.0, -0.4, -1.5, 0.0, 0.0],
    ]
)
ROLL = torch.tensor(
    [
        [0.0, -0.6, -0.2, -0.25, 0.0],  # deltas +0.1, -0.8, +0.05
        [0.0, 0.0, -1.2, -2.1, -0.2],  # deltas +1.1, +0.1, -0.1
        [0.0, -2.0, 0.0, 0.0, 0.0],  # delta +1.3
        [0.0, -0.4, -1.4, 0.0, 0.0],  # deltas 0.0, -0.1
    ]
)
CAP = 2.0


def _deltas() -> list[list[float]]:
    return [[OLD[b, t].item() - ROLL[b, t].item() for t in range(5) if MASK[b, t]] for b in range(4)]


def test_token_tis_and_mis_weights_match_a_hand_computation():
    w, m = importance_weights(OLD, ROLL, MASK, "tis", CAP, "token")
    expected = torch.zeros(4, 5)
    flat = []
    for b in range(4):
        ts = [t for t in range(5) if MASK[b, t]]
        for t, d in zip(ts, _deltas()[b]):
            expected[b, t] = min(math.exp(d), CAP)
            flat.append(math.exp(d))
    torch.testing.assert_close(w, expected)
    assert m["rollout/is_clipped_frac"].item() == pytest.approx(sum(r > CAP for r in flat) / len(flat))
    assert m["rollout/is_weight_mean"].item() == pytest.approx(sum(min(r, CAP) for r in flat) / len(flat))

    w, m = importance_weights(OLD, ROLL, MASK, "mis", CAP, "token")
    kept = [r if 1 / CAP <= r <= CAP else 0.0 for r in flat]
    assert sorted(w[MASK].tolist()) == pytest.approx(sorted(kept))
    assert m["rollout/is_clipped_frac"].item() == pytest.approx(sum(k == 0.0 for k in kept) / len(kept))


def test_sequence_weights_are_the_truncated_product_of_token_ratios():
    seq = [math.exp(sum(d)) for d in _deltas()]  # [0.53, 3.0, 3.67, 0.90]
    w, m = importance_weights(OLD, ROLL, MASK, "tis", CAP, "sequence")
    assert w.shape == (4, 1)
    assert w.squeeze(1).tolist() == pytest.approx([min(r, CAP) for r in seq], rel=1e-6)
    assert m["rollout/is_clipped_frac"].item() == pytest.approx(0.5)
    w, _ = importance_weights(OLD, ROLL, MASK, "mis", CAP, "sequence")
    assert w.squeeze(1).tolist() == pytest.approx([r if 1 / CAP <= r <= CAP else 0.0 for r in seq], rel=1e-6)


def test_mismatch_metrics_and_nan_stays_nan():
    m = mismatch_metrics(OLD, ROLL, MASK)
    flat = [abs(d) for ds in _deltas() for d in ds]
    assert m["rollout/logprob_diff_mean"].item() == pytest.approx(sum(flat) / len(flat))
    assert m["rollout/logprob_diff_max"].item() == pytest.approx(max(flat))
    assert m["rollout/kl_seq"].item() == pytest.approx(sum(-sum(d) for d in _deltas()) / 4)
    k3 = sum(sum(math.exp(d) - 1 - d for d in ds) for ds in _deltas()) / 4
    assert m["rollout/k3_kl_seq"].item() == pytest.approx(k3)
    garbage_off_response = ROLL.clone()
    garbage_off_response[2, 3] = float("nan")
    assert all(math.isfinite(v.item()) for v in mismatch_metrics(OLD, garbage_off_response, MASK).values())
    broken = ROLL.clone()
    broken[1, 3] = float("nan")  # a response token: the engine returned NaN
    assert all(math.isnan(v.item()) for v in mismatch_metrics(OLD, broken, MASK).values())


def _inputs(is_weights, advantages=None) -> tuple[TrainBatch, torch.Tensor]:
    logp = (OLD + 0.1 * torch.arange(5.0)).requires_grad_(True)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    extra = {} if advantages is None else {"advantages": advantages}
    return loss_batch(OLD, MASK, scores, 2, is_weights=is_weights, **extra), logp


def test_policy_surrogate_is_multiplied_per_token():
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    w, _ = importance_weights(OLD, ROLL, MASK, "tis", CAP, "token")
    cfg = PolicyLossConfig(adv_estimator="grpo")
    x, logp = _inputs(w, adv)
    loss, _ = LOSSES["grpo"].fn(x, logp, cfg)
    total, count = 0.0, 0
    for b in range(4):
        for t in range(5):
            if MASK[b, t]:
                ratio = math.exp(logp[b, t].item() - OLD[b, t].item())
                a = adv[b].item()
                term = max(-a * ratio, -a * min(max(ratio, 0.8), 1.2))
                total += w[b, t].item() * term
                count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-5)


def test_pacs_bce_weight_is_multiplied_per_row():
    w, _ = importance_weights(OLD, ROLL, MASK, "tis", CAP, "sequence")
    x, logp = _inputs(w)
    cfg = PACSConfig(weight_mode="question")
    loss, _ = LOSSES["pacs"].fn(x, logp, cfg)
    r = [sum(logp[b, t].item() - OLD[b, t].item() for t in range(5) if MASK[b, t]) for b in range(4)]
    psi = [r[0] - r[1], r[1] - r[0], r[2] - r[3], r[3] - r[2]]  # rloo with n = 2
    y = [1.0, 0.0, 0.0, 1.0]  # both groups mixed: class weights 2 / (2 * 1) = 1
    expected = 0.0
    for i in range(4):
        p = 1 / (1 + math.exp(-psi[i]))
        expected += -w[i, 0].item() * (y[i] * math.log(p) + (1 - y[i]) * math.log(1 - p))
    assert loss.item() == pytest.approx(expected / 4, rel=1e-5)
    unweighted, _ = LOSSES["pacs"].fn(*_inputs(None), cfg)
    assert loss.item() != pytest.approx(unweighted.item())
    with pytest.raises(ValueError, match="sequence-level"):
        LOSSES["pacs"].fn(*_inputs(torch.ones(4, 5)), cfg)


def test_correction_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="algorithm.is_level=token with algorithm.loss=pacs"):
        load_config(None, ["algorithm.rollout_correction=tis", "algorithm.is_level=token"])
    with pytest.raises(ConfigError, match="algorithm.is_cap"):
        load_config(None, ["algorithm.is_cap=1.0"])
    with pytest.raises(ConfigError, match="algorithm.rollout_correction"):
        load_config(None, ["algorithm.rollout_correction=clip"])
    cfg = load_config(None, ["algorithm.loss=grpo", "algorithm.rollout_correction=mis"])
    assert cfg.algorithm.resolved_is_level == "token"


def test_engine_logprobs_land_on_the_response_positions_and_doctests_run():
    import doctest

    import pacs_megatron.pacs.rollout_correction as rc
    from pacs_megatron.batch.build import build_rollouts, response_values

    b = build_rollouts([[5, 6, 7], [5, 6, 7]], [[1, 2], [3]], [1.0, 0.0], group_size=2, pad_id=0)
    v = response_values(b, [[-0.1, -0.2], [-0.3]])
    assert v[b.response_mask].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert v[~b.response_mask].abs().sum().item() == 0.0
    assert response_values(b, [[-0.1, -0.2], None]) is None  # an engine without log-probs: no metrics
    with pytest.raises(ValueError, match="row 1"):
        response_values(b, [[-0.1, -0.2], [-0.3, -0.4]])
    result = doctest.testmod(rc)
    assert result.attempted > 0 and result.failed == 0
