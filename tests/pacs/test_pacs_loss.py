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


# ----------------------------------------------------------------- rows with loss weight 0 leave their group


def _row_grads(scores, keep, n=4, weight_mode="question", est="rloo", seed=0):
    """d loss / d sum_t logp per row, at the start of a step (logp = anchor, psi = 0), with ``keep`` as the
    sequence-level is_weights (0 = dropped: a truncated row under mask_truncated, or an MIS rejection)."""
    torch.manual_seed(seed)
    b = len(scores)
    old = -torch.rand(b, 5, dtype=torch.float64)
    logp = old.clone().requires_grad_(True)
    mask = torch.ones(b, 5, dtype=torch.bool)
    w = torch.tensor(keep, dtype=torch.float64).reshape(-1, 1)
    cfg = PACSConfig(weight_mode=weight_mode, adv_estimator=est)
    loss, _ = pacs_loss(logp, old, mask, torch.tensor(scores), n, cfg, is_weights=w)
    loss.backward()
    return logp.grad[:, 1]  # every token of a row has the row's d loss / d r (beta = 1)


def test_masked_row_of_an_all_wrong_group_gets_no_gradient():
    # The review's case: all wrong, row 3 truncated. The old code gave [0.056, 0.056, 0.056, -0.167] (x 4/3 in the
    # review's units: [0.22, 0.22, 0.22, -0.67]): descent raised the truncated answer's likelihood. Over the kept
    # rows the group is all wrong with one class: RLOO's gradient sums to 0 per row.
    g = _row_grads([0.0, 0.0, 0.0, 0.0], [1, 1, 1, 0])
    assert g[3].item() == 0.0
    assert torch.allclose(g, torch.zeros(4, dtype=torch.float64), atol=1e-15)


def test_masked_row_of_a_mixed_group_leaves_baseline_and_class_weights():
    # [1, 1, 0, 0] with row 3 masked: over the kept rows R = [1, 1, 0], class weights 3/(2*2), 3/(2*1); RLOO over 3;
    # dL/dr_j = 1/3 sum_i w_i (1/2 - R_i) dpsi_i/dr_j = [-0.1875, -0.1875, 0.375, 0] (old code: [.., 0.278, 0.056]).
    g = _row_grads([1.0, 1.0, 0.0, 0.0], [1, 1, 1, 0])
    assert g[3].item() == 0.0
    assert torch.allclose(g, torch.tensor([-0.1875, -0.1875, 0.375, 0.0], dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("est", ["rloo", "grpo"])
@pytest.mark.parametrize("score", [0.0, 1.0])
def test_a_row_left_alone_in_its_group_leaves_it_like_a_whole_one_class_group(est, score):
    # The review's case: three of four rows dropped, the lone kept row has no baseline. With psi = r (verl's rule
    # for a group of one) a lone wrong row was pushed down (and a right one up), while the whole group of one
    # outcome gets no net gradient. Now the lone row leaves too: gradient 0, and the group is counted.
    g = _row_grads([score] * 4, [1, 0, 0, 0], est=est)
    assert torch.equal(g, torch.zeros(4, dtype=torch.float64))
    assert torch.allclose(_row_grads([score] * 4, [1, 1, 1, 1], est=est), torch.zeros(4, dtype=torch.float64))
    logp = -torch.rand(8, 3, dtype=torch.float64)
    w = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1], dtype=torch.float64)
    _, m = pacs_loss(logp + 0.1, logp, torch.ones(8, 3, dtype=torch.bool), torch.ones(8), 4, PACSConfig(), is_weights=w)
    assert m["pacs/lone_row_groups"].item() == 1.0


@pytest.mark.parametrize("est", ["rloo", "grpo"])
def test_masked_row_gradient_is_zero_even_when_its_logprobs_are_nan(est):
    b = 4
    old = -torch.rand(b, 3, dtype=torch.float64)
    logp = old.clone()
    logp[2, 1] = float("nan")  # a dropped row may hold anything
    logp.requires_grad_(True)
    w = torch.tensor([[1.0], [1.0], [0.0], [1.0]], dtype=torch.float64)
    loss, m = pacs_loss(
        logp,
        old,
        torch.ones(b, 3, dtype=torch.bool),
        torch.tensor([1.0, 0.0, 1.0, 0.0]),
        4,
        PACSConfig(adv_estimator=est),
        is_weights=w,
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and bool((logp.grad[2] == 0).all())
    assert torch.isfinite(m["pacs/psi_mean"])


def test_groups_without_a_masked_row_are_bit_identical_to_the_unmasked_loss():
    # Two groups: the first has a dropped row, the second none. The second group's psi, weights and gradient are
    # those of the loss without any weights, bit for bit; all-ones weights give the unweighted loss bit for bit.
    logp, old, mask, _ = _toy()
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    for est in ("rloo", "grpo"):
        cfg = PACSConfig(adv_estimator=est)
        plain = logp.clone().requires_grad_(True)
        ref, _ = pacs_loss(plain, old, mask, scores, 3, cfg)
        ref.backward()
        ones = logp.clone().requires_grad_(True)
        same, _ = pacs_loss(ones, old, mask, scores, 3, cfg, is_weights=torch.ones(6, 1, dtype=torch.float64))
        same.backward()
        assert torch.equal(same, ref) and torch.equal(ones.grad, plain.grad)
        # group 2 alone, with and without a dropped row in group 1: its rows' psi are the same numbers
        r = implicit_reward(logp, old, mask, 1.0)
        full = group_advantage(r, 3, est)
        kept = group_advantage(r, 3, est, keep=torch.tensor([1, 0, 1, 1, 1, 1]).bool())
        assert torch.equal(kept[3:], full[3:])
        w_full = class_weights(scores, 3, "question")
        w_kept = class_weights(scores, 3, "question", torch.tensor([1, 0, 1, 1, 1, 1]).bool())
        assert torch.equal(w_kept[3:], w_full[3:]) and w_kept[:3].tolist() == [1.0, 1.0, 1.0]


def test_reference_anchor_measures_r_against_ref_logp():
    from pacs_megatron.batch.rows import loss_batch
    from pacs_megatron.pacs import get_loss

    logp, old, mask, scores = _toy()
    ref = old - 0.25
    x = loss_batch(old, mask, scores, 3, ref_logp=ref)
    v1, _ = get_loss("pacs").fn(x, logp, PACSConfig())
    v2, _ = get_loss("pacs").fn(x, logp, PACSConfig(anchor="reference"))
    assert torch.equal(v1, pacs_loss(logp, old, mask, scores, 3, PACSConfig())[0])
    assert torch.equal(v2, pacs_loss(logp, ref, mask, scores, 3, PACSConfig(anchor="reference"))[0])
    with pytest.raises(ValueError, match="ref_logp"):
        get_loss("pacs").fn(loss_batch(old, mask, scores, 3), logp, PACSConfig(anchor="reference"))
    with pytest.raises(ValueError, match="anchor"):
        PACSConfig(anchor="ref")
    with pytest.raises(ValueError, match="sum_ratio"):
        PACSConfig(anchor="reference", reward_method="mean_logp")


def test_brier_and_psi_spread():
    psi = torch.tensor([2.0, -2.0, 0.0, 0.0])
    from pacs_megatron.pacs.loss import classifier_metrics

    m = classifier_metrics(psi, psi, torch.tensor([1.0, 0.0, 1.0, 0.0]), 2)
    s = torch.sigmoid(torch.tensor(2.0)).item()
    assert m["pacs/brier"].item() == pytest.approx(((1 - s) ** 2 * 2 + 0.25 * 2) / 4)
    assert m["pacs/psi_std"].item() == pytest.approx(math.sqrt(2.0))
