"""GSPO (pacs/policy_loss.py::gspo_policy_loss, ``algorithm.loss=gspo``) against verl's
``compute_policy_loss_gspo`` written out here in plain Python on a table of cases, its gradient against the
paper's sequence-level gradient, and its config and registry wiring.

verl's formula, per row i with response tokens T_i and advantage A_i:
    log s_i   = 1/|T_i| sum_{t in T_i} (logp_t - old_t)
    l_{i,t}   = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))      (the same value at every t)
    loss      = agg(l, "seq-mean-token-mean") = 1/B sum_i 1/|T_i| sum_t l_{i,t}
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from pacs_megatron.batch.rows import TrainBatch, loss_batch
from pacs_megatron.config import AlgorithmConfig, ConfigError, load_config
from pacs_megatron.pacs import LOSSES
from pacs_megatron.pacs.config import GSPOConfig
from pacs_megatron.pacs.policy_loss import gspo_policy_loss

MASK = [[0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 1, 0, 0, 0]]
OLD = [[0.0, -0.5, -1.0, -0.2, 0.0], [0.0, -2.0, -0.1, 0.0, 0.0], [0.0, -0.7, -0.3, -1.1, -0.4], [0.0, -0.9, 0, 0, 0]]
# Per-row shifts of the log-ratio around the clip range (eps 3e-4 / 4e-4): inside, above, below, far above.
SHIFT = [[0, 1e-4, -2e-4, 2e-4, 0], [0, 2e-3, 1e-3, 0, 0], [0, -1e-3, -5e-4, 0.0, -1e-3], [0, 0.5, 0, 0, 0]]


def _verl(logp, old, mask, adv, lo, hi, mode="seq-mean-token-mean"):
    """verl's gspo loss and the paper's gradient d loss / d logp_{i,t}, from Python floats."""
    rows, grads = [], []
    for i in range(len(logp)):
        ts = [t for t in range(len(logp[i])) if mask[i][t]]
        s = math.exp(min(sum(logp[i][t] - old[i][t] for t in ts) / len(ts), 10.0))
        a = adv[i]
        clipped = min(max(s, 1 - lo), 1 + hi)
        term = max(-a * s, -a * clipped)
        rows.append((term, len(ts)))
        # The clipped branch is constant; the unclipped one has d(-A s)/d logp_t = -A s / |T_i|.
        active = -a * s >= -a * clipped
        grads.append({t: (-a * s / len(ts) if active else 0.0) for t in ts})
    if mode == "seq-mean-token-mean":
        loss = sum(term for term, _ in rows) / len(rows)
        grad = [{t: g / len(rows) for t, g in gi.items()} for gi in grads]
    else:  # token-mean
        n = sum(k for _, k in rows)
        loss = sum(term * k for term, k in rows) / n
        grad = [{t: g * k / n for t, g in gi.items()} for gi, (_, k) in zip(grads, rows)]
    return loss, grad


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("adv", [[1.0, 1.0, -0.5, 2.0], [-1.0, -0.3, 0.7, -2.0]])
def test_gspo_equals_verls_formula_and_the_papers_gradient(adv, mode):
    logp = [[o + d for o, d in zip(ro, rd)] for ro, rd in zip(OLD, SHIFT)]
    lo, hi = 3e-4, 4e-4
    cfg = GSPOConfig(loss_agg_mode=mode)
    x = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.bool)
    old, a = torch.tensor(OLD, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64)
    loss, m = gspo_policy_loss(x, old, mask, a, cfg)
    expected, grad = _verl(logp, OLD, MASK, adv, lo, hi, mode)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    (g,) = torch.autograd.grad(loss, x)
    for i, gi in enumerate(grad):
        for t in range(5):
            assert g[i, t].item() == pytest.approx(gi.get(t, 0.0), rel=1e-9, abs=1e-18), (i, t)
    # Rows 1 and 3 sit above 1 + eps_high, row 2 below 1 - eps_low: clipped exactly where A pushes outward.
    clipped_rows = [i for i in range(4) if all(gi == 0.0 for gi in grad[i].values())]
    assert clipped_rows == [i for i, a in enumerate(adv) if (i in (1, 3) and a > 0) or (i == 2 and a < 0)]
    clipped_tokens = sum(len(grad[i]) for i in clipped_rows)
    assert m["policy/clipfrac"].item() == pytest.approx(clipped_tokens / sum(map(sum, MASK)))


def test_token_form_equals_the_sequence_objective_in_value_and_gradient():
    """verl's stop-gradient token form is the paper's J = mean_i max(-A s_i, -A clip(s_i)) with s_i
    differentiated directly (seq-mean-token-mean), on random data with default clip ranges."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 7, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(6, 7, generator=g) > 0.3
    mask[:, 0] = True
    logp = (old + 2e-4 * torch.randn(6, 7, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    loss, _ = gspo_policy_loss(logp, old, mask, adv, GSPOConfig())
    m = mask.double()
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))
    ref = torch.maximum(-adv * s, -adv * s.clamp(1 - 3e-4, 1 + 4e-4)).mean()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    g1, g2 = (torch.autograd.grad(v, logp)[0] for v in (loss, ref))
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-14)


def test_at_theta_old_the_loss_is_minus_the_mean_advantage_and_padding_is_ignored():
    old = torch.tensor(OLD, dtype=torch.float64)
    old_nan = old.masked_fill(~torch.tensor(MASK, dtype=torch.bool), float("nan"))  # padding may hold anything
    adv = torch.tensor([1.0, -2.0, 0.5, 0.25])
    loss, _ = gspo_policy_loss(old.clone(), old_nan, torch.tensor(MASK, dtype=torch.bool), adv, GSPOConfig())
    assert loss.item() == pytest.approx(-adv.mean().item())


def test_rejected_tokens_leave_the_sequence_ratio():
    """is_weights 0 (masked IS / IcePop) take a token out of s_i's mean, as verl's rejection mask does."""
    logp = torch.tensor([[0.0, -0.4, -1.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, -0.4002, -1.0001, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True, True]])
    w = torch.tensor([[0.0, 1.0, 1.0, 0.0]])  # the third token's ratio was an outlier
    loss, _ = gspo_policy_loss(logp, old, mask, torch.tensor([1.0]), GSPOConfig(), is_weights=w)
    kept, _ = gspo_policy_loss(logp, old, torch.tensor([[False, True, True, False]]), torch.tensor([1.0]), GSPOConfig())
    assert loss.item() == kept.item()


def test_gspo_is_registered_with_verls_defaults():
    spec = LOSSES["gspo"]
    assert spec.traits.outcome_advantages is not None and spec.unit == "agg" and spec.traits.section == "gspo"
    cfg = AlgorithmConfig(loss="gspo").loss_config()
    assert isinstance(cfg, GSPOConfig)
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.loss_agg_mode, cfg.adv_estimator, cfg.clip_ratio_c) == (
        3e-4,
        4e-4,
        "seq-mean-token-mean",
        "grpo",
        0.0,
    )
    assert AlgorithmConfig(loss="gspo").correction().unit == "token"
    mask = torch.tensor(MASK, dtype=torch.bool)
    x = loss_batch(torch.tensor(OLD), mask, torch.zeros(4), 2, advantages=torch.ones(4))
    assert spec.denominator(x, cfg).item() == 4.0  # rows (sequence-level aggregation)
    # A TrainBatch cannot exist without advantages (no None sentinel for the loss to reject any more).
    with pytest.raises(TypeError, match="advantages"):
        TrainBatch(**{f.name: getattr(x, f.name) for f in fields(TrainBatch) if f.name != "advantages"})


def test_gspo_config_errors_name_the_field():
    cfg = load_config(None, ["algorithm.loss=gspo", "algorithm.gspo.clip_ratio_high=0.001"])
    assert cfg.algorithm.loss_config().clip_ratio_high == 0.001
    with pytest.raises(ConfigError, match="algorithm.gspo.clip_ratio_c=3.0: GSPO has no dual-clip"):
        load_config(None, ["algorithm.loss=gspo", "algorithm.gspo.clip_ratio_c=3.0"])
    with pytest.raises(ConfigError, match="algorithm.gspo.adv_estimator='gae'"):
        load_config(None, ["algorithm.gspo.adv_estimator=gae"])
    with pytest.raises(ConfigError, match="algorithm.gspo.clip_ratio_low=1.5 must be in"):
        load_config(None, ["algorithm.gspo.clip_ratio_low=1.5"])
