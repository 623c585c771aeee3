"""KL-to-reference and entropy terms on PACS, GRPO and PPO, against plain-torch formulas written out here."""

import pytest
import torch

from pacs_megatron.batch.rows import TrainBatch, loss_batch
from pacs_megatron.pacs import PACSConfig, PolicyLossConfig, get_loss, regularize
from pacs_megatron.pacs.regularizers import KL_TYPES, kl_estimate

G = torch.Generator().manual_seed(3)
B, T, N = 8, 6, 2  # 4 groups of 2
MASK = torch.zeros(B, T, dtype=torch.bool)
for b, (s, e) in enumerate([(1, 4), (2, 6), (1, 2), (3, 6), (1, 5), (2, 3), (1, 6), (4, 6)]):
    MASK[b, s:e] = True


def _inputs(**kw) -> tuple[TrainBatch, torch.Tensor, torch.Tensor | None]:
    """(batch, current log-probs, current entropy); ``kw`` overrides the batch's fields or ``entropy``."""
    logp = (-torch.rand(B, T, generator=G, dtype=torch.float64) * 2).requires_grad_()
    base = dict(
        old_logp=logp.detach() + 0.1 * torch.randn(B, T, generator=G, dtype=torch.float64),
        response_mask=MASK,
        scores=torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]),
        group_size=N,
        advantages=torch.randn(B, generator=G, dtype=torch.float64),
        ref_logp=logp.detach() + 0.3 * torch.randn(B, T, generator=G, dtype=torch.float64),
        entropy=(torch.rand(B, T, generator=G, dtype=torch.float64) * 3).requires_grad_(),
    )
    base = base | kw
    entropy = base.pop("entropy")
    return loss_batch(**base), logp, entropy


def _kl(lp, ref, kind):
    """Schulman's estimators as verl names them (kl_penalty_forward), straight from the formulas."""
    kind = kind.rstrip("+")
    if kind in ("k1", "kl"):
        return lp - ref
    if kind == "abs":
        return (lp - ref).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (lp - ref) ** 2
    return torch.clamp(torch.exp(ref - lp) - (ref - lp) - 1, -10, 10)  # verl clamps k3 to +-10


def _agg(mat, mask, mode):
    """verl's agg_loss over the rows that keep a token (a rejected row is no sequence)."""
    rows = mask.any(-1)
    mat, m = mat[rows], mask[rows].double()
    if mode == "token-mean":
        return (mat * m).sum() / m.sum()
    if mode == "seq-mean-token-sum":
        return (mat * m).sum(-1).mean()
    if mode == "seq-mean-token-mean":  # also PACS's: per-row token mean, mean over rows
        return ((mat * m).sum(-1) / m.sum(-1)).mean()
    return (mat * m).sum(-1).mean() / mat.shape[-1]


@pytest.mark.parametrize("kind", KL_TYPES)
def test_estimators_are_the_published_formulas(kind):
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-2.0, -1.0, -0.5, -0.1], dtype=torch.float64)
    got = kl_estimate(lp, ref, kind)
    assert torch.allclose(got, _kl(lp, ref, kind), rtol=1e-12)
    (g,) = torch.autograd.grad(got.sum(), lp)
    if kind.endswith("+"):  # straight through: k2's gradient (lp - ref) under this value
        assert torch.allclose(g, lp.detach() - ref)
    if kind in ("k3", "low_var_kl"):  # >= 0, 0 at equality, d/dlp = 1 - exp(ref - lp); the last one is clamped
        assert (got >= 0).all() and got[2] == 0 and got[3] == 10.0
        assert torch.allclose(g[:3], 1 - torch.exp(ref[:3] - lp.detach()[:3])) and g[3] == 0
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_estimate(lp, ref, "full")


def test_switched_off_is_the_same_loss_object():
    spec = get_loss("pacs")
    assert regularize(spec, 0.0, "low_var_kl", 0.0) is spec
    assert not spec.needs_entropy and regularize(spec, 0.0, "k1", 0.01).needs_entropy
    assert not regularize(spec, 0.1, "k1", 0.0).needs_entropy


CASES = [
    ("pacs", PACSConfig(), "seq-mean-token-mean"),
    ("grpo", PolicyLossConfig(adv_estimator="grpo"), "token-mean"),
    ("grpo", PolicyLossConfig(adv_estimator="grpo", loss_agg_mode="seq-mean-token-sum"), "seq-mean-token-sum"),
    ("ppo", PolicyLossConfig(adv_estimator="rloo", loss_agg_mode="seq-mean-token-mean"), "seq-mean-token-mean"),
    ("ppo", PolicyLossConfig(adv_estimator="rloo", loss_agg_mode="seq-mean-token-sum-norm"), "norm"),
]


@pytest.mark.parametrize("name, cfg, mode", CASES)
@pytest.mark.parametrize("kind", ["k1", "k2", "low_var_kl"])
def test_loss_and_gradient_equal_plain_torch(name, cfg, mode, kind):
    x, logp, ent = _inputs()
    spec = get_loss(name)
    loss, metrics = regularize(spec, 0.3, kind, 0.05).fn(x, logp, cfg, ent)
    base, _ = spec.fn(x, logp, cfg, ent)
    kl = _agg(_kl(logp, x.ref_logp, kind), MASK, mode)
    entropy = _agg(ent, MASK, mode)
    want = base + 0.3 * kl - 0.05 * entropy
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert metrics["actor/kl_loss"].item() == pytest.approx(kl.item(), rel=1e-12)
    assert metrics["actor/entropy_loss"].item() == pytest.approx(entropy.item(), rel=1e-12)
    got = torch.autograd.grad(loss, [logp, ent])
    ref = torch.autograd.grad(want, [logp, ent])
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-14) for a, b in zip(got, ref))


@pytest.mark.parametrize("name, cfg, mode", CASES)
def test_rejected_rows_leave_the_terms_and_micro_batches_add_up(name, cfg, mode):
    """Masked IS (or a truncated row, weight 0) removes a row from the KL / entropy means as from the loss (PACS:
    and the row it left alone in its group); micro-batches weighted by their denominators give the full batch's
    regularized loss exactly."""
    w = torch.tensor([[1.0], [0.0], [1.5], [1.0], [0.7], [1.0], [0.0], [1.0]], dtype=torch.float64)
    x, logp, ent = _inputs(is_weights=w)
    spec = regularize(get_loss(name), 0.3, "k3", 0.05)
    loss, metrics = spec.fn(x, logp, cfg, ent)
    kept = MASK & (w != 0)
    if name == "pacs":  # rows 0 and 7 are alone in their groups of 2
        kept = kept & torch.tensor([0, 0, 1, 1, 1, 1, 0, 0], dtype=torch.bool)[:, None]
    assert metrics["actor/kl_loss"].item() == pytest.approx(_agg(_kl(logp, x.ref_logp, "k3"), kept, mode).item())
    assert metrics["actor/entropy_loss"].item() == pytest.approx(_agg(ent, kept, mode).item())
    parts = []
    for start, stop in ((0, 4), (4, 8)):
        part = x.rows(start, stop)
        value, _ = spec.fn(part, logp[start:stop], cfg, ent[start:stop])
        parts.append((value, spec.denominator(part, cfg)))
    total = sum(v * n for v, n in parts) / sum(n for _, n in parts)
    assert total.item() == pytest.approx(loss.item(), rel=1e-12)


def test_missing_inputs_are_named():
    x, logp, ent = _inputs(ref_logp=None)
    with pytest.raises(ValueError, match="ref_logp"):
        regularize(get_loss("grpo"), 0.1, "k1", 0.0).fn(x, logp, PolicyLossConfig(adv_estimator="grpo"), ent)
    with pytest.raises(ValueError, match="entropy"):
        x, logp, ent = _inputs(entropy=None)
        regularize(get_loss("pacs"), 0.0, "k1", 0.1).fn(x, logp, PACSConfig(), ent)
