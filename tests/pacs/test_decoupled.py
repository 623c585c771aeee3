"""The decoupled off-policy correction (pacs/decoupled.py, issue 31 item 3).

(a) at k = 0 (behaviour log-probs == proximal) the decoupled PACS / GRPO / PPO losses and gradients equal
    today's loss (old log-probs = the actor's, no weights) bit for bit, for tis and mis at both levels;
(b) with stale samples PACS's implicit reward is measured from the proximal policy: at theta = prox it is 0
    (psi = 0, loss = ln 2 per row) whatever the staleness, while behaviour log-probs would start it elsewhere;
(c) the weights pi_prox / pi_b turn behaviour samples into proximal expectations (Monte Carlo, below the cap);
(d) staleness per row and its metrics.
"""

from __future__ import annotations

import math

import pytest
import torch

from pacs_megatron.pacs import PACSConfig, PolicyLossConfig, clipped_policy_loss, pacs_loss
from pacs_megatron.pacs.config import RolloutCorrectionConfig
from pacs_megatron.pacs.decoupled import decoupled_old_logp, staleness, staleness_metrics
from pacs_megatron.pacs.implicit import implicit_reward

B, T, N = 8, 6, 4


def _corr(weight: str, cap: float, level: str) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig(weight=weight, cap=cap, level=level, unit="row" if level == "sequence" else "token")


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(B, T, generator=g, dtype=torch.float64).float() * 3
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :2] = False  # prompt
    mask[1, 5] = mask[6, 4:] = False  # short responses
    scores = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1])
    logp = (prox + 0.05 * torch.randn(B, T, generator=g)).requires_grad_(True)
    return logp, prox, mask, scores


def _loss(name: str, logp, old, mask, scores, w):
    if name == "pacs":
        return pacs_loss(logp, old, mask, scores, N, PACSConfig(beta=1.0), is_weights=w)[0]
    adv = torch.linspace(-1, 1, B)
    est = "grpo" if name == "grpo" else "rloo"
    return clipped_policy_loss(logp, old, mask, adv, PolicyLossConfig(adv_estimator=est), is_weights=w)[0]


@pytest.mark.parametrize("name", ["pacs", "grpo", "ppo"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_at_k0_the_decoupled_loss_is_todays_loss_bit_for_bit(name, mode):
    level = "sequence" if name == "pacs" else "token"
    logp, prox, mask, scores = _batch()
    old, w, metrics = decoupled_old_logp(prox, prox.clone(), mask, _corr(mode, 2.0, level))
    assert old is prox and float(metrics["rollout/logprob_diff_max"]) == 0.0
    assert bool((w[mask if level == "token" else slice(None)] == 1).all())
    today = _loss(name, logp, prox, mask, scores, None)
    (g_today,) = torch.autograd.grad(today, logp)
    decoupled = _loss(name, logp, old, mask, scores, w)
    (g_dec,) = torch.autograd.grad(decoupled, logp)
    assert torch.equal(today, decoupled) and torch.equal(g_today, g_dec)


def test_pacs_reward_starts_from_the_proximal_policy_whatever_the_staleness():
    _, prox, mask, scores = _batch()
    behaviour = prox - 0.3 * torch.rand(B, T, generator=torch.Generator().manual_seed(1))  # an older policy
    old, w, m = decoupled_old_logp(prox, behaviour, mask, _corr("tis", 100.0, "sequence"))
    theta = prox.clone().requires_grad_(True)  # the first mini-batch of the update: theta = prox
    assert torch.equal(implicit_reward(theta, old, mask, 1.0), torch.zeros(B))
    loss, metrics = pacs_loss(theta, old, mask, scores, N, PACSConfig(beta=1.0, weight_mode=None), is_weights=w)
    assert float(metrics["pacs/psi_abs_mean"]) == 0.0
    assert math.isclose(float(loss.detach()), math.log(2) * float(w.mean()), rel_tol=1e-6)  # ln 2 per row, IS-weighted
    assert float(m["rollout/logprob_diff_mean"]) > 0.1  # the staleness shows in the mismatch metrics, not in r
    coupled = implicit_reward(theta, behaviour, mask, 1.0)  # r against the behaviour policy: not 0
    assert float(coupled.abs().min()) > 0.05


def test_weights_turn_behaviour_samples_into_proximal_expectations():
    """One-token responses from 5 answers: E_b[w f] = E_prox[f] when no weight reaches the cap."""
    g = torch.Generator().manual_seed(0)
    p_b = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    p_prox = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    f = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0])
    y = torch.multinomial(p_b, 200_000, replacement=True, generator=g)
    mask = torch.ones(len(y), 1, dtype=torch.bool)
    _, w, _ = decoupled_old_logp(p_prox.log()[y, None], p_b.log()[y, None], mask, _corr("tis", 10.0, "sequence"))
    estimate = float((w.squeeze(1) * f[y]).mean())
    assert abs(estimate - float((p_prox * f).sum())) < 0.02
    assert abs(float(f[y].mean()) - float((p_prox * f).sum())) > 0.2  # uncorrected: clearly off


def test_without_behaviour_logprobs_or_correction_there_are_no_weights():
    _, prox, mask, _ = _batch()
    assert decoupled_old_logp(prox, None, mask, _corr("tis", 2.0, "token")) == (prox, None, {})
    old, w, m = decoupled_old_logp(prox, prox - 0.1, mask, _corr("none", 2.0, "token"))
    assert old is prox and w is None and "rollout/kl_seq" in m and "rollout/is_weight_mean" not in m


def test_staleness_and_its_metrics():
    assert staleness(torch.tensor([5, 3, 4]), 5).tolist() == [0, 2, 1]
    with pytest.raises(ValueError, match="newer than the proximal policy 4"):
        staleness(torch.tensor([5]), 4)
    m = staleness_metrics(torch.tensor([5, 3, 4, 4]), 5, max_staleness=2)
    assert m["async/staleness_mean"] == 1.0 and m["async/staleness_max"] == 2.0
    assert [m[f"async/staleness_frac_{j}"] for j in range(3)] == [0.25, 0.5, 0.25]
