"""PACS loss against numbers computed independently, in plain Python, from the paper's formulas."""

import math

import pytest
import torch

from pacs_megatron.pacs import PACSConfig, class_weights, group_advantage, implicit_reward, pacs_loss


def bce(x: float, y: float) -> float:
    return -(y * math.log(1 / (1 + math.exp(-x))) + (1 - y) * math.log(1 - 1 / (1 + math.exp(-x))))


def _toy():
    # 2 groups x 3 responses, T = 4 (position 0 is the prompt, trailing zeros of the mask = padding).
    logp = torch.tensor(
        [
            [0.0, -0.5, -1.0, -0.2],
            [0.0, -0.3, -0.1, -9.0],
            [0.0, -2.0, -0.4, -0.4],
            [0.0, -0.7, -0.6, -0.5],
            [0.0, -0.1, -3.0, -3.0],
            [0.0, -1.5, -0.3, -0.9],
        ],
        dtype=torch.float64,
    )
    old = logp - torch.tensor([0.1, 0.2, -0.3, 0.05, 0.0, -0.1], dtype=torch.float64).unsqueeze(1)
    mask = torch.tensor(
        [[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool
    )
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    return logp, old, mask, scores


def _expected_rewards(logp, old, mask, beta, method):
    out = []
    for i in range(logp.shape[0]):
        toks = [t for t in range(logp.shape[1]) if mask[i, t]]
        if method == "sum_ratio":
            out.append(beta * sum(float(logp[i, t] - old[i, t]) for t in toks))
        else:
            out.append(beta * sum(float(logp[i, t]) for t in toks) / len(toks))
    return out


def _expected_psi(r, n, est):
    psi = []
    for g in range(0, len(r), n):
        grp = r[g : g + n]
        mean = sum(grp) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (n - 1))
        for x in grp:
            if est == "rloo":
                psi.append(x - (sum(grp) - x) / (n - 1))
            elif est == "grpo":
                psi.append((x - mean) / (std + 1e-6))
            else:
                psi.append(x)
    return psi


def _expected_weights(scores, n, mode):
    w = []
    for g in range(0, len(scores), n):
        grp = [float(s) for s in scores[g : g + n]]
        npos = sum(grp)
        for s in grp:
            if mode is None:
                w.append(1.0)
            elif mode == "only_positive":
                w.append(1.0 if s == 1 else 0.0)
            elif mode == "only_negative":
                w.append(1.0 if s == 0 else 0.0)
            elif 0 < npos < n:  # sklearn "balanced": n_samples / (n_classes * count)
                w.append(n / (2 * (npos if s == 1 else n - npos)))
            else:
                w.append(1.0)
    return w


@pytest.mark.parametrize("method", ["sum_ratio", "mean_logp"])
@pytest.mark.parametrize("est", ["rloo", "grpo", "naive"])
@pytest.mark.parametrize("mode", [None, "question", "only_positive", "only_negative"])
@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_pacs_loss_matches_hand_computation(method, est, mode, beta):
    logp, old, mask, scores = _toy()
    cfg = PACSConfig(beta=beta, reward_method=method, adv_estimator=est, weight_mode=mode)
    loss, metrics = pacs_loss(logp, old, mask, scores, 3, cfg)
    r = _expected_rewards(logp, old, mask, beta, method)
    psi = _expected_psi(r, 3, est)
    w = _expected_weights(scores.tolist(), 3, mode)
    expected = sum(wi * bce(p, float(s)) for wi, p, s in zip(w, psi, scores)) / len(psi)
    assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert metrics["pacs/psi_mean"].item() == pytest.approx(sum(psi) / 6, abs=1e-9)
    assert metrics["pacs/implicit_reward_abs_mean"].item() == pytest.approx(sum(abs(x) for x in r) / 6, abs=1e-9)
    # group 0 has both outcomes, group 1 is all-correct
    assert metrics["pacs/mixed_group_frac"].item() == pytest.approx(0.5)


def test_grpo_without_std_is_centred_reward():
    r = torch.tensor([1.0, 2.0, 6.0, 0.0])
    out = group_advantage(r, 2, "grpo", norm_by_std=False)
    assert out.tolist() == [-0.5, 0.5, 3.0, -3.0]


def test_rloo_reference_numbers():
    # r = [1, 2, 6]: 1 - (2+6)/2 = -3, 2 - 3.5 = -1.5, 6 - 1.5 = 4.5
    assert group_advantage(torch.tensor([1.0, 2.0, 6.0]), 3, "rloo").tolist() == [-3.0, -1.5, 4.5]


def test_question_weights_balanced():
    w = class_weights(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 4, "question")
    assert w.tolist() == pytest.approx([2.0, 2 / 3, 2 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0])


def test_gradient_is_sigmoid_minus_score_times_dpsi():
    """d loss / d theta = 1/B sum_i w_i (sigmoid(psi_i) - R_i) d psi_i / d theta on a toy parametrisation."""
    torch.manual_seed(0)
    B, T, n = 8, 5, 4
    theta = torch.randn(B, T, dtype=torch.float64, requires_grad=True)
    old = torch.randn(B, T, dtype=torch.float64)
    mask = torch.rand(B, T) > 0.3
    scores = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1])
    cfg = PACSConfig(beta=1.5, weight_mode="question")
    logp = torch.nn.functional.logsigmoid(theta)  # any smooth map theta -> logp
    loss, _ = pacs_loss(logp, old, mask, scores, n, cfg)
    (g_auto,) = torch.autograd.grad(loss, theta, retain_graph=True)

    r = implicit_reward(logp, old, mask, 1.5)
    psi = group_advantage(r, n, "rloo")
    w = class_weights(scores, n, "question").double()
    coef = (w * (torch.sigmoid(psi) - scores.double()) / B).detach()
    (g_manual,) = torch.autograd.grad((coef * psi).sum(), theta)
    torch.testing.assert_close(g_auto, g_manual, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["sum_ratio", "mean_logp"])
def test_padding_invariance(method):
    logp, old, mask, scores = _toy()
    cfg = PACSConfig(reward_method=method)
    loss, _ = pacs_loss(logp, old, mask, scores, 3, cfg)
    pad = torch.randn(6, 5, dtype=torch.float64) * 10  # garbage in the padded positions
    loss_padded, _ = pacs_loss(
        torch.cat([logp, pad], 1),
        torch.cat([old, -pad], 1),
        torch.cat([mask, torch.zeros(6, 5, dtype=torch.bool)], 1),
        scores,
        3,
        cfg,
    )
    assert loss_padded.item() == loss.item()


def test_group_order_validation():
    logp, old, mask, scores = _toy()
    ids = torch.tensor([0, 0, 1, 1, 1, 0])
    with pytest.raises(ValueError, match="must be contiguous"):
        pacs_loss(logp, old, mask, scores, 3, PACSConfig(), group_ids=ids)
    with pytest.raises(ValueError, match="whole number of groups"):
        pacs_loss(logp[:5], old[:5], mask[:5], scores[:5], 3, PACSConfig())
    with pytest.raises(ValueError, match="two separate blocks"):
        pacs_loss(logp, old, mask, scores, 3, PACSConfig(), group_ids=torch.tensor([0, 0, 0, 0, 0, 0]).repeat(1))


def test_weight_modes_need_binary_scores():
    logp, old, mask, _ = _toy()
    with pytest.raises(ValueError, match="0/1"):
        pacs_loss(logp, old, mask, torch.full((6,), 0.5), 3, PACSConfig(weight_mode="question"))


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="beta"):
        PACSConfig(beta=0)
    with pytest.raises(ValueError, match="adv_estimator"):
        PACSConfig(adv_estimator="gae")
    with pytest.raises(ValueError, match="weight_mode"):
        PACSConfig(weight_mode="balanced")
