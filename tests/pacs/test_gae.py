"""GAE advantages, the clipped value loss and the Dr.GRPO aggregation, against hand computations
(plain Python loops in the test, not the code under test)."""

import math

import pytest
import torch

from pacs_megatron.pacs import (
    PolicyLossConfig,
    clipped_policy_loss,
    explained_variance,
    gae_advantages,
    outcome_token_rewards,
    value_loss,
)

# Row 0: prompt at t=0, response t=1..3. Row 1: prompt t=0..1, response t=2..3, then padding t=4.
MASK = [[0, 1, 1, 1, 0], [0, 0, 1, 1, 0]]
VALUES = [[9.0, 0.2, 0.5, 0.7, 9.0], [9.0, 9.0, -0.3, 0.4, 9.0]]
SCORES = [1.0, 0.0]


def _hand_gae(rewards, values, mask, gamma, lam):
    """Per row: walk the response positions only, backwards (prompt/padding values never enter)."""
    adv = [[0.0] * len(r) for r in rewards]
    for b in range(len(rewards)):
        pos = [t for t in range(len(mask[b])) if mask[b][t]]
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(pos):
            delta = rewards[b][t] + gamma * nxt_v - values[b][t]
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = values[b][t]
            adv[b][t] = nxt_a
    return adv


def _hand_whiten(adv, mask):
    xs = [adv[b][t] for b in range(len(adv)) for t in range(len(adv[b])) if mask[b][t]]
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)  # unbiased
    return [
        [(adv[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b][t] else 0.0 for t in range(len(adv[b]))]
        for b in range(len(adv))
    ]


def test_outcome_reward_on_last_response_token():
    r = outcome_token_rewards(torch.tensor(SCORES), torch.tensor(MASK))
    assert r.tolist() == [[0, 0, 0, 1.0, 0], [0, 0, 0, 0.0, 0]]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_matches_hand_computation_with_masking(gamma, lam):
    rewards = [[0, 0, 0, 1.0, 0], [0, 0, 0, 0.0, 0]]
    adv, ret = gae_advantages(torch.tensor(rewards), torch.tensor(VALUES), torch.tensor(MASK), gamma, lam, whiten=False)
    exp = _hand_gae(rewards, VALUES, MASK, gamma, lam)
    for b in range(2):
        for t in range(5):
            want_a = exp[b][t] if MASK[b][t] else 0.0
            want_r = exp[b][t] + VALUES[b][t] if MASK[b][t] else 0.0
            assert adv[b, t].item() == pytest.approx(want_a, abs=1e-6)
            assert ret[b, t].item() == pytest.approx(want_r, abs=1e-6)
    if gamma == lam == 1.0:  # the reference's setting: every advantage is R - V_t
        assert adv[0, 1].item() == pytest.approx(1.0 - 0.2) and adv[1, 2].item() == pytest.approx(0.3)
        assert ret[0, 1:4].tolist() == pytest.approx([1.0, 1.0, 1.0])
    # The garbage values on prompt/padding positions (9.0) must not leak anywhere.
    v2 = torch.tensor(VALUES).masked_fill(~torch.tensor(MASK).bool(), -5.0)
    adv2, ret2 = gae_advantages(torch.tensor(rewards), v2, torch.tensor(MASK), gamma, lam, whiten=False)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_gae_whitening_is_unbiased_over_response_tokens():
    rewards = [[0, 0, 0, 1.0, 0], [0, 0, 0, 0.0, 0]]
    adv, _ = gae_advantages(torch.tensor(rewards), torch.tensor(VALUES), torch.tensor(MASK), 1.0, 1.0)
    want = _hand_whiten(_hand_gae(rewards, VALUES, MASK, 1.0, 1.0), MASK)
    assert adv.tolist() == [pytest.approx(r, abs=1e-5) for r in want]


def test_value_loss_matches_hand_computation():
    vpred = [[0.0, 0.9, 0.1, 0.5], [0.0, -0.4, 0.2, 7.0]]
    old = [[0.0, 0.5, 0.2, 0.45], [0.0, 0.1, 0.1, 0.0]]
    ret = [[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    mask = [[0, 1, 1, 1], [0, 1, 1, 0]]
    c = 0.2
    terms, clipped = [], 0
    for b in range(2):
        for t in range(4):
            if not mask[b][t]:
                continue
            vc = min(max(vpred[b][t], old[b][t] - c), old[b][t] + c)
            l1, l2 = (vpred[b][t] - ret[b][t]) ** 2, (vc - ret[b][t]) ** 2
            terms.append(max(l1, l2))
            clipped += l2 > l1
    v = torch.tensor(vpred, requires_grad=True)
    loss, frac = value_loss(v, torch.tensor(ret), torch.tensor(old), torch.tensor(mask), c)
    assert loss.item() == pytest.approx(sum(terms) / len(terms))  # token-mean, no 0.5 (the reference)
    assert frac.item() == pytest.approx(clipped / len(terms))
    loss.backward()
    assert v.grad[1, 3] == 0 and v.grad[0, 0] == 0  # masked positions get no gradient


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    val = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # Var(R)=1 over (1,2,3); R-V = (0,0,1): var = 1/3.
    assert explained_variance(val, ret, mask).item() == pytest.approx(1 - 1 / 3)
    # Every response scored 0 (a collapsed policy): constant returns leave nothing to explain.
    zeros = torch.zeros(1, 4)
    assert math.isnan(explained_variance(val, zeros, mask).item())
    assert math.isnan(explained_variance(val, zeros + 1e-9 * torch.tensor([[1.0, 0.0, 0.0, 0.0]]), mask).item())


def test_dr_grpo_aggregation_and_token_advantages():
    logp = torch.tensor([[0.0, -0.1, -1.0], [0.0, -0.2, -0.9]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    adv_tok = torch.tensor([[0.0, 1.5, -0.5], [0.0, 0.3, 0.0]], dtype=torch.float64)
    # ratio = 1 (logp == old): per-token loss is -A; Dr.GRPO: row token-sums, mean over rows, / H.
    rows = [-(1.5 - 0.5), -0.3]
    for horizon in (0, 10):
        cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm", adv_estimator="gae", loss_agg_horizon=horizon)
        loss, _ = clipped_policy_loss(logp, logp.clone(), mask, adv_tok, cfg)
        assert loss.item() == pytest.approx(sum(rows) / 2 / (horizon or 3))
    with pytest.raises(ValueError, match="advantages must be"):
        clipped_policy_loss(logp, logp, mask, adv_tok[:, :2], cfg)
