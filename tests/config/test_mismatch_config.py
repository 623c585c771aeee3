"""``algorithm.rollout_correction``'s menu in the config (off by default, composable, bad values named with the
fix) and in the step (update_stages.rollout_mismatch, update_stages.forward_rows)."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.batch.rows import as_train_batch
from pacs_megatron.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def test_off_by_default_and_in_every_shipped_recipe():
    assert not load_config().algorithm.correction().active
    for path in sorted(CONFIGS.glob("*.yaml")):
        c = load_config(path).algorithm.correction()
        assert not c.masks, path.name  # the recipes that use tis (FP8) take no mask unless they say so


@pytest.mark.parametrize(
    "spec, weight, masks",
    [
        ("tis", "tis", ()),
        ("icepop", "none", ("icepop",)),
        ("geo+tis+icepop", "tis", ("icepop", "geo")),
        ("mis+outlier", "mis", ("outlier",)),
        ("icepop+geo+outlier", "none", ("icepop", "geo", "outlier")),
    ],
)
def test_parts_compose_in_any_order(spec, weight, masks):
    for loss, unit, level in (("pacs", "row", "sequence"), ("grpo", "token", "token"), ("gspo", "token", "token")):
        c = load_config(None, [f"algorithm.loss={loss}", f"algorithm.rollout_correction={spec}"]).algorithm.correction()
        assert (c.weight, c.masks, c.unit, c.level) == (weight, masks, unit, level)


def test_bounds_are_overridable():
    over = ["algorithm.rollout_correction=icepop+geo+outlier", "algorithm.icepop_bounds=[0.4,2.5]"]
    c = load_config(None, [*over, "algorithm.geo_bounds=[0.98,1.02]", "algorithm.outlier_bounds=[0,1000]"])
    assert c.algorithm.correction().icepop == (0.4, 2.5)
    assert c.algorithm.correction().geo == (0.98, 1.02) and c.algorithm.correction().outlier == (0, 1000)


@pytest.mark.parametrize(
    "override, words",
    [
        ("algorithm.rollout_correction=tis+mis", "algorithm.rollout_correction='tis\\+mis' names two importance"),
        ("algorithm.rollout_correction=icepop+icepop", "algorithm.rollout_correction='icepop\\+icepop': use 'none'"),
        ("algorithm.rollout_correction=veto", "algorithm.rollout_correction='veto'"),
        ("algorithm.rollout_correction=none+tis", "algorithm.rollout_correction='none\\+tis'"),
        ("algorithm.icepop_bounds=[2.0,0.5]", "algorithm.icepop_bounds=\\[2.0, 0.5\\] must be \\[low, high\\]"),
        ("algorithm.geo_bounds=[0.99]", "algorithm.geo_bounds"),
        ("algorithm.outlier_bounds=[-1,100]", "algorithm.outlier_bounds"),
    ],
)
def test_errors_name_the_field(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, [override])


def _batch(cfg_overrides: list[str]):
    cfg = load_config(None, ["algorithm.loss=grpo", *cfg_overrides])
    b = build_rollouts([[5, 6], [5, 6]], [[1, 2, 3], [4, 5]], [1.0, 0.0], group_size=2, pad_id=0)
    old = torch.full(b.input_ids.shape, -1.0)
    roll = old.clone()
    roll[0][b.response_mask[0]] = torch.tensor([-1.0, -2.0, -1.0])  # one token with ratio e = 2.7: IcePop's
    return cfg, as_train_batch(b, old, rollout_logp=roll)


def test_the_step_applies_the_masks_and_keeps_the_truncation_weights():
    from pacs_megatron.loop.update_stages import forward_rows, rollout_mismatch

    cfg, local = _batch(["algorithm.rollout_correction=icepop"])
    assert forward_rows(cfg, 1) == 0  # the masks need pi_old before the first loss, like tis / mis
    out, metrics = rollout_mismatch(cfg, replace(local, is_weights=torch.tensor([[1.0], [0.0]])))  # row 1 truncated
    assert out.is_weights[0][local.response_mask[0]].tolist() == [1.0, 0.0, 1.0]
    assert out.is_weights[1].abs().sum().item() == 0.0
    assert metrics["rollout/icepop_masked_frac"].item() == pytest.approx(1 / 5)
    assert metrics["rollout/ratio_p50"].item() == pytest.approx(1.0)
    cfg, local = _batch([])
    out, metrics = rollout_mismatch(cfg, local)
    assert out.is_weights is None and "rollout/ratio_p99" in metrics and "rollout/icepop_masked_frac" not in metrics
