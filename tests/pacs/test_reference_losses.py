"""The baselines' losses against the PACS reference's formulas (ritzz-ai/PACS, its vendored verl
``trainer/ppo/core_algos.py``), each re-derived here in a few commented lines, not imported:
the value loss (no 0.5, aggregated), dual-clip PPO, masked-IS rejection out of the denominators, and
where our GAE's terminal bootstrap (0) equals the reference's (lam = 1 only)."""

import pytest
import torch

from pacs_megatron.batch.rows import loss_batch
from pacs_megatron.pacs import PACSConfig, PolicyLossConfig, clipped_policy_loss, get_loss, value_loss
from pacs_megatron.pacs.gae import gae_advantages, outcome_token_rewards

G = torch.Generator().manual_seed(0)
MASK = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0]])


def _ref_agg(mat, mask, mode):
    """verl ``agg_loss``: masked mean / row token-sums averaged / row token-means averaged / the SUM of
    row token-sums over the row length (ours divides the mean by H: see the Dr.GRPO test)."""
    m = mask.double()
    if mode == "token-mean":
        return (mat * m).sum() / m.sum()
    if mode == "seq-mean-token-sum":
        return (mat * m).sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return ((mat * m).sum(-1) / m.sum(-1)).mean()
    return (mat * m).sum(-1).sum() / mask.shape[-1]


def _ref_value_loss(vpreds, returns, values, mask, clip, mode="token-mean"):
    """verl ``compute_value_loss``: max of the plain and the clipped squared errors, aggregated; no 0.5."""
    vclip = torch.clamp(vpreds, values - clip, values + clip)
    return _ref_agg(torch.max((vpreds - returns) ** 2, (vclip - returns) ** 2), mask, mode)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_value_loss_equals_the_reference(mode):
    v = torch.randn(MASK.shape, generator=G, dtype=torch.float64)
    ret, old = torch.randn(MASK.shape, generator=G, dtype=torch.float64), v + 0.3 * torch.randn(MASK.shape, generator=G)
    if mode == "token-mean":  # the default arguments are the reference function's defaults
        loss, _ = value_loss(v, ret, old, MASK, 0.2)
    else:
        loss, _ = value_loss(v, ret, old, MASK, 0.2, mode)
    want = _ref_value_loss(v, ret, old, MASK, 0.2, mode)
    if mode == "seq-mean-token-sum-norm":  # ours: mean over rows / H; the reference: sum over rows / H
        want = want / MASK.shape[0]
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)


def test_critic_loss_agg_mode_defaults_to_the_actors():
    from pacs_megatron.config import AlgorithmConfig, CriticConfig, RunConfig, critic_loss_agg
    from pacs_megatron.config.base import ConfigError

    policy = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_agg_horizon=4096, adv_estimator="gae")
    cfg = RunConfig(algorithm=AlgorithmConfig(loss="ppo", policy=policy))
    assert CriticConfig().loss_agg_mode == "auto"
    assert critic_loss_agg(cfg.critic, cfg.algorithm, 1024) == ("seq-mean-token-sum-norm", 4096)
    cfg.critic.loss_agg_mode = "token-mean"
    assert critic_loss_agg(cfg.critic, cfg.algorithm, 0)[0] == "token-mean"
    with pytest.raises(ConfigError, match="critic.loss_agg_mode"):
        CriticConfig(loss_agg_mode="mean")


def _ref_dual_clip(logp, old, adv, mask, low, high, c):
    """verl ``compute_policy_loss``: PPO-clip, then for A < 0 the loss is capped at -A * c."""
    ratio = torch.exp(logp - old)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    l3 = -adv * c
    losses = torch.where(adv < 0, torch.min(l3, clip1), clip1)
    lower = ((clip1 > l3) & (adv < 0)).double()
    return _ref_agg(losses, mask, "token-mean"), (lower * mask).sum() / mask.sum()


def test_dual_clip_equals_the_reference():
    old = torch.zeros(MASK.shape, dtype=torch.float64)
    # log-ratios up to +-2: ratios past 3 with negative advantages, so the dual clip acts
    logp = (2.0 * torch.rand(MASK.shape, generator=G, dtype=torch.float64) - 1.0) * 2.0
    adv = torch.randn(MASK.shape, generator=G, dtype=torch.float64)
    cfg = PolicyLossConfig(adv_estimator="gae")
    assert cfg.clip_ratio_c == 3.0  # the reference's default
    loss, metrics = clipped_policy_loss(logp, old, MASK, adv, cfg)
    want, lower = _ref_dual_clip(logp, old, adv, MASK, 0.2, 0.2, 3.0)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert metrics["policy/clipfrac_lower"].item() == pytest.approx(lower.item()) and lower > 0
    off, _ = clipped_policy_loss(logp, old, MASK, adv, PolicyLossConfig(adv_estimator="gae", clip_ratio_c=0))
    assert off.item() > loss.item()  # without the cap the negative-advantage tokens weigh more
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=0.5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_mis_rejection_leaves_the_denominator(mode):
    """A rejected unit (masked IS weight 0) counts as if it had never been sampled: the loss equals
    the loss of the batch without it, and the registry's denominator does not count it."""
    logp = 0.1 * torch.randn(MASK.shape, generator=G, dtype=torch.float64)
    old = torch.zeros(MASK.shape, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.7], dtype=torch.float64)
    cfg = PolicyLossConfig(adv_estimator="grpo", loss_agg_mode=mode, loss_agg_horizon=6)
    spec = get_loss("grpo")
    # Token level: one token of row 0 and all of row 2 rejected; the rest kept at weight 1.
    w = MASK.double().clone()
    w[0, 2] = 0.0
    w[2] = 0.0
    keep = MASK.bool() & (w > 0)
    loss, _ = clipped_policy_loss(logp, old, MASK, adv, cfg, is_weights=w)
    want, _ = clipped_policy_loss(logp[[0, 1, 3]], old[[0, 1, 3]], keep[[0, 1, 3]], adv[[0, 1, 3]], cfg)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    x = loss_batch(old, MASK, torch.zeros(4), 1, advantages=adv, is_weights=w)
    want_n = keep.sum() if mode == "token-mean" else 3
    assert spec.denominator(x, cfg).item() == want_n
    # Sequence level ([B, 1]): row 1 rejected.
    ws = torch.tensor([[1.0], [0.0], [1.0], [1.0]], dtype=torch.float64)
    loss, _ = clipped_policy_loss(logp, old, MASK, adv, cfg, is_weights=ws)
    want, _ = clipped_policy_loss(logp[[0, 2, 3]], old[[0, 2, 3]], MASK[[0, 2, 3]], adv[[0, 2, 3]], cfg)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)


def test_mis_rejected_pacs_rows_leave_the_mean():
    """PACS: the BCE mean runs over the rows masked IS kept, and a rejected row leaves its group's baseline
    (pacs/advantage.py): row 0 is left alone in its group, with no baseline, so it leaves too (it was kept with
    psi = r, verl's group of one, before issue 56): the mean is over rows 2 and 3, and the denominator says 2."""
    logp = 0.2 * torch.randn(MASK.shape, generator=G, dtype=torch.float64)
    old = torch.zeros(MASK.shape, dtype=torch.float64)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    cfg = PACSConfig(weight_mode=None)
    w = torch.tensor([[1.0], [0.0], [1.0], [1.0]], dtype=torch.float64)
    spec = get_loss("pacs")
    loss, _ = spec.fn(loss_batch(old, MASK, scores, 2, is_weights=w), logp, cfg)
    # by hand: RLOO of the implicit rewards within each group of 2, BCE per row, mean over kept rows 2, 3
    r = (logp * MASK).sum(-1)
    psi = torch.stack([r[0], r[1] - r[0], r[2] - r[3], r[3] - r[2]])
    bce = torch.nn.functional.binary_cross_entropy_with_logits(psi, scores.double(), reduction="none")
    assert loss.item() == pytest.approx(bce[[2, 3]].mean().item(), rel=1e-12)
    assert spec.denominator(loss_batch(old, MASK, scores, 2, is_weights=w), cfg).item() == 2


def _ref_gae(rewards, values, gamma, lam):
    """verl ``compute_gae_advantage_return`` (no whitening): the recursion over every column of the
    response window, bootstrapping from the next column's value whatever it holds."""
    T = rewards.shape[1]
    last, out = 0.0, []
    for t in reversed(range(T)):
        nxt = values[:, t + 1] if t < T - 1 else 0.0
        last = rewards[:, t] + gamma * nxt - values[:, t] + gamma * lam * last
        out.append(last)
    return torch.stack(out[::-1], dim=1)


def test_terminal_bootstrap_matches_the_reference_only_at_lambda_one():
    """The reference's critic leaves the value after the last response token unmasked (its shifted
    mask, volcengine/verl#1758), so its bootstrap there is that value; ours is 0."""
    # Response-only windows (the reference's layout): row 0 ends at t=2, then one padding column.
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    values = torch.tensor([[0.2, 0.4, 0.6, 0.9], [0.1, -0.2, 0.3, 0.5]], dtype=torch.float64)
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.0]), mask).double()
    for lam, equal in ((1.0, True), (0.9, False)):
        ours, _ = gae_advantages(rewards, values, mask, 1.0, lam, whiten=False)
        ref = _ref_gae(rewards, values, 1.0, lam) * mask
        assert torch.allclose(ours.double(), ref, atol=1e-6) is equal, lam
