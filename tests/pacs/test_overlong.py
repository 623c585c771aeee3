"""DAPO's overlong handling against its published formula on hand-made lengths."""

import pytest
import torch

from pacs_megatron.pacs.overlong import overlong_metrics, overlong_penalty, truncation_weights


def _dapo_eq13(length: int, l_max: int, l_cache: int) -> float:
    """DAPO (arXiv 2503.14476) eq. 13, the soft overlong punishment, case by case."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def _verl_dapo(length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    """verl ``workers/reward_manager/dapo.py``: min(-exceed_len / overlong_buffer_len * penalty_factor, 0)."""
    exceed_len = length - (max_resp_len - buffer_len)
    return min(-exceed_len / buffer_len * factor, 0)


LENGTHS = [0, 1, 12, 16, 17, 18, 19, 20]


@pytest.mark.parametrize("factor", [1.0, 0.5, 2.0])
def test_penalty_is_dapos_formula(factor):
    got = overlong_penalty(torch.tensor(LENGTHS), max_len=20, buffer_len=4, factor=factor).tolist()
    assert got == pytest.approx([factor * _dapo_eq13(n, 20, 4) for n in LENGTHS], abs=1e-7)
    assert got == pytest.approx([_verl_dapo(n, 20, 4, factor) for n in LENGTHS], abs=1e-7)
    # by hand: 16 is the last free length, 20 (the maximum) costs the whole factor
    assert got[3] == 0.0 and got[4] == pytest.approx(-0.25 * factor) and got[-1] == pytest.approx(-factor)


def test_no_buffer_is_no_penalty_and_bad_buffers_are_refused():
    assert overlong_penalty(torch.tensor(LENGTHS), 20, 0, 1.0).tolist() == [0.0] * len(LENGTHS)
    whole = overlong_penalty(torch.tensor([0, 10, 20]), 20, 20, 1.0).tolist()  # buffer = max: a length penalty
    assert whole == pytest.approx([0.0, -0.5, -1.0])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), 20, 21, 1.0)


def test_truncated_rows_get_weight_zero_and_metrics():
    truncated = torch.tensor([False, True, False, True])
    assert truncation_weights(truncated).flatten().tolist() == [1.0, 0.0, 1.0, 0.0]
    prior = torch.tensor([[0.5], [2.0], [1.5], [1.0]])  # e.g. importance weights: multiplied, not replaced
    assert truncation_weights(truncated, prior).flatten().tolist() == [0.5, 0.0, 1.5, 0.0]
    token = torch.full((4, 3), 2.0)
    assert truncation_weights(truncated, token).sum(1).tolist() == [6.0, 0.0, 6.0, 0.0]
    penalty = overlong_penalty(torch.tensor([10, 19, 20, 20]), 20, 4, 1.0)
    m = overlong_metrics(penalty, truncated, masked=True)
    assert m["overlong/penalty_mean"].item() == pytest.approx((-0.75 - 1 - 1) / 4)
    assert m["overlong/penalized_frac"].item() == 0.75 and m["overlong/masked_frac"].item() == 0.5
    assert "overlong/masked_frac" not in overlong_metrics(penalty, truncated, masked=False)
