"""The train/inference mismatch menu (pacs/rollout_correction.py::correction_weights): IcePop, the geometric-mean
row mask and the outlier row mask, alone and composed with TIS / MIS, against tables computed here from the
upstream formulas in plain Python (math.exp on each token's log-ratio):

- IcePop = SkyRL's ``compute_token_mask``: token kept iff low <= rho_t <= high;
- geo = verl's ``rollout_rs="geometric"`` / SkyRL's ``sequence_mask_metric="geometric"``: row kept iff
  low <= exp(mean_t log rho_t) <= high;
- outlier = SkyRL's ``compute_outlier_token_mask`` (row kept iff every token is inside [low, high]); with
  high = inf it is verl's ``rollout_token_veto_threshold`` (row rejected iff a token is below low);
- the composition is verl's / SkyRL's: the weight times every mask.
"""

from __future__ import annotations

import math

import pytest
import torch

from pacs_megatron.batch.rows import loss_batch
from pacs_megatron.pacs import LOSSES, PACSConfig
from pacs_megatron.pacs.config import RolloutCorrectionConfig
from pacs_megatron.pacs.rollout_correction import correction_weights, mismatch_metrics, quantiles

# 5 rows; column 0 is a prompt token; response tokens where MASK is 1. Log-ratios delta = OLD - ROLL chosen so
# each mask has rows on both sides of its default bounds (ln 2 = 0.693, ln 0.5 = -0.693, ln 1.01 = 0.00995).
MASK = torch.tensor(
    [[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 1]],
    dtype=torch.bool,
)
DELTA = [
    [0.0, 0.004, -0.002, 0.001],  # all near 1: kept by every mask
    [0.0, 0.8, -0.9, 0.0],  # two IcePop tokens, geo mean exp(-0.05): outside [0.99, 1.01]
    [0.0, -10.0, 5.0, 5.0],  # outliers both ways (4.5e-5 < 1e-4, 148 > 100) but geo mean exactly 1
    [0.0, 0.02, 0.0, 0.0],  # one token, geo mean 1.0202: outside geo, inside IcePop
    [0.0, 0.3, -0.3, 0.005],  # geo exp(0.00167): inside; IcePop keeps all; TIS and MIS leave all alone
]
ROLL = -torch.rand(5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
OLD = ROLL + torch.tensor(DELTA, dtype=torch.float64)


def _rho(b: int) -> list[float]:
    return [math.exp(DELTA[b][t]) for t in range(4) if MASK[b, t]]


def _tokens(b: int) -> list[int]:
    return [t for t in range(4) if MASK[b, t]]


def _icepop(r: float, lo: float = 0.5, hi: float = 2.0) -> bool:
    return lo <= r <= hi


def _geo_ok(b: int, lo: float = 0.99, hi: float = 1.01) -> bool:
    return lo <= math.exp(sum(math.log(r) for r in _rho(b)) / len(_rho(b))) <= hi


def _outlier_ok(b: int, lo: float = 1e-4, hi: float = 100.0) -> bool:
    return all(lo <= r <= hi for r in _rho(b))


def _weights(masks: tuple[str, ...], weight: str = "none", unit: str = "token", level: str = "token", cap=2.0):
    cfg = RolloutCorrectionConfig(weight=weight, masks=masks, cap=cap, level=level, unit=unit)
    return correction_weights(OLD, ROLL, MASK, cfg)


def _token_table(masks, weight="none", cap=2.0):
    """The expected [B, T] weights: upstream's weight (1, min(rho, C) or MIS) times every mask."""
    out = torch.zeros(5, 4, dtype=torch.float64)
    for b in range(5):
        row_ok = ("geo" not in masks or _geo_ok(b)) and ("outlier" not in masks or _outlier_ok(b))
        for t, r in zip(_tokens(b), _rho(b)):
            w = {"none": 1.0, "tis": min(r, cap), "mis": r if 1 / cap <= r <= cap else 0.0}[weight]
            out[b, t] = w * row_ok * ("icepop" not in masks or _icepop(r))
    return out


@pytest.mark.parametrize(
    ("masks", "weight"),
    [
        (("icepop",), "none"),
        (("geo",), "none"),
        (("outlier",), "none"),
        (("icepop",), "tis"),
        (("geo", "outlier"), "tis"),
        (("icepop", "geo", "outlier"), "mis"),
    ],
)
def test_token_weights_equal_the_upstream_formulas(masks, weight):
    w, m = _weights(masks, weight)
    expected = _token_table(masks, weight)
    torch.testing.assert_close(w.double(), expected, rtol=1e-6, atol=0)
    assert bool((w[~MASK] == 0).all())
    n_tok, rows = int(MASK.sum()), 5
    if "icepop" in masks:
        outside = sum(not _icepop(r) for b in range(5) for r in _rho(b))
        assert m["rollout/icepop_masked_frac"].item() == pytest.approx(outside / n_tok)
    if "geo" in masks:
        assert m["rollout/geo_masked_frac"].item() == pytest.approx(sum(not _geo_ok(b) for b in range(5)) / rows)
    if "outlier" in masks:
        assert m["rollout/outlier_masked_frac"].item() == pytest.approx(sum(not _outlier_ok(b) for b in range(5)) / 5)
    zeros = int(((expected == 0) & MASK).sum())
    assert m["rollout/masked_token_frac"].item() == pytest.approx(zeros / n_tok)
    dead_rows = sum(all(expected[b, t] == 0 for t in _tokens(b)) for b in range(5))
    assert m["rollout/masked_row_frac"].item() == pytest.approx(dead_rows / rows)


def test_the_table_exercises_every_mask():
    """Guard on the fixture: each mask keeps some rows and drops others, so the table above can fail."""
    assert [_geo_ok(b) for b in range(5)] == [True, False, True, False, True]  # row 2: outlier, yet geo keeps it
    assert [_outlier_ok(b) for b in range(5)] == [True, True, False, True, True]
    assert [all(_icepop(r) for r in _rho(b)) for b in range(5)] == [True, False, False, True, True]


def test_icepop_with_tis_at_its_high_bound_is_icepops_own_weight():
    """IcePop's M(rho) = rho * 1[a <= rho <= b]: "tis+icepop" with is_cap = b gives exactly that."""
    w, _ = _weights(("icepop",), "tis", cap=2.0)
    for b in range(5):
        for t, r in zip(_tokens(b), _rho(b)):
            assert w[b, t].item() == pytest.approx(r * _icepop(r), rel=1e-6)


def test_outlier_with_no_high_bound_is_verls_token_veto():
    veto = 1e-3  # verl: a row with any token rho < veto is rejected, whatever its other tokens
    cfg = RolloutCorrectionConfig(masks=("outlier",), outlier=(veto, math.inf))
    w, _ = correction_weights(OLD, ROLL, MASK, cfg)
    for b in range(5):
        vetoed = any(r < veto for r in _rho(b))
        assert bool((w[b, _tokens(b)] == 0).all()) == vetoed and bool((w[b, _tokens(b)] != 0).all()) != vetoed


def test_custom_bounds_move_the_masks():
    cfg = RolloutCorrectionConfig(masks=("icepop", "geo"), icepop=(0.3, 3.0), geo=(0.9, 1.1))
    w, _ = correction_weights(OLD, ROLL, MASK, cfg)
    for b in range(5):
        for t, r in zip(_tokens(b), _rho(b)):
            assert w[b, t].item() == float(_icepop(r, 0.3, 3.0) and _geo_ok(b, 0.9, 1.1))


def test_sequence_tis_with_a_token_mask_broadcasts_over_the_row():
    w, _ = _weights(("icepop",), "tis", level="sequence")
    for b in range(5):
        seq = min(math.exp(sum(math.log(r) for r in _rho(b))), 2.0)
        for t, r in zip(_tokens(b), _rho(b)):
            assert w[b, t].item() == pytest.approx(seq * _icepop(r), rel=1e-6)


def test_pacs_rows_drop_whole_on_any_masked_token_and_leave_the_loss():
    w, m = _weights(("icepop", "geo"), "tis", unit="row", level="sequence")
    assert w.shape == (5, 1)
    keep = [all(_icepop(r) for r in _rho(b)) and _geo_ok(b) for b in range(5)]
    assert [bool(x) for x in (w.squeeze(1) != 0)] == keep == [True, False, False, False, True]
    for b in (0, 4):
        assert w[b, 0].item() == pytest.approx(min(math.exp(sum(DELTA[b])), 2.0), rel=1e-6)
    assert m["rollout/masked_row_frac"].item() == pytest.approx(3 / 5)
    # PACS reads weight 0 as "rejected": the loss's denominator counts the kept rows only.
    x = loss_batch(OLD.float(), MASK, torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]), 5, is_weights=w)
    assert LOSSES["pacs"].denominator(x, PACSConfig()).item() == 2.0


def test_a_nan_ratio_on_a_masked_token_gets_weight_exactly_zero():
    """A product weight * mask would give NaN * 0 = NaN; the menu's masked units are exactly 0."""
    roll = ROLL.clone()
    roll[1, 1] = float("nan")
    cfg = RolloutCorrectionConfig(weight="tis", masks=("icepop",))
    w, _ = correction_weights(OLD, roll, MASK, cfg)
    assert w[1, 1].item() == 0.0 and torch.isfinite(w).all()
    assert all(math.isnan(v.item()) for k, v in mismatch_metrics(OLD, roll, MASK).items() if "ratio" in k)


def test_nothing_on_gives_no_weights():
    assert correction_weights(OLD, ROLL, MASK, RolloutCorrectionConfig()) == (None, {})


def test_ratio_quantiles_match_torch_quantile():
    m = mismatch_metrics(OLD, ROLL, MASK)
    flat = torch.tensor([r for b in range(5) for r in _rho(b)], dtype=torch.float64)
    geo = torch.tensor([math.exp(sum(DELTA[b]) / len(_rho(b))) for b in range(5)], dtype=torch.float64)
    for q, name in ((0.01, "p01"), (0.5, "p50"), (0.99, "p99")):
        # torch.quantile interpolates the ratios, ours the log-ratios: equal at p50 of an odd count only,
        # so compare with the log-space quantile, exponentiated.
        assert m[f"rollout/ratio_{name}"].item() == pytest.approx(torch.quantile(flat.log(), q).exp().item(), rel=1e-9)
        assert m[f"rollout/geo_ratio_{name}"].item() == pytest.approx(torch.quantile(geo.log(), q).exp().item())
    x = torch.randn(1001, dtype=torch.float64)
    qs = torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)
    assert [v.item() for v in quantiles(x)] == pytest.approx(torch.quantile(x, qs).tolist())
