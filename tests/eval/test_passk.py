"""pass@k against brute-force enumeration of k-subsets; dataset aggregation from known scores."""

import itertools
import math
from fractions import Fraction

import pytest

from pacs_megatron.eval.passk import dataset_metrics, pass_at_k
from pacs_megatron.eval.runner import check_k, compute_metrics, flatten_metrics, parse_k_list


def brute_force(n: int, c: int, k: int) -> float:
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_equals_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_stable():
    # the ratio of binomials as exact fractions vs the product form (math.comb ratios overflow floats)
    for n, c, k in [(1024, 3, 512), (1000, 1, 1), (500, 17, 64), (256, 0, 128)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12)


def test_pass_at_k_argument_errors():
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c=5"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k=\\[8\\]"):
        check_k([1, 8], 4)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_k_list("1,four")
    assert parse_k_list("16, 1,4,4") == [1, 4, 16]


def test_dataset_metrics_from_known_scores():
    # problem 1: 1 of 4 correct; problem 2: 3 of 4 (0.9 counts as correct, 0.2 does not)
    scores = [[1.0, 0.0, 0.0, 0.0], [0.9, 1.0, 1.0, 0.2]]
    m = dataset_metrics(scores, [1, 2, 4])
    assert m["pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert m["pass@2"] == pytest.approx((brute_force(4, 1, 2) + brute_force(4, 3, 2)) / 2)
    assert m["pass@4"] == pytest.approx(1.0)
    assert m["mean@n"] == pytest.approx((1.0 + 0.9 + 1.0 + 1.0 + 0.2) / 8)
    with pytest.raises(ValueError, match="different sample counts"):
        dataset_metrics([[1.0], [1.0, 0.0]], [1])


def test_compute_metrics_per_dataset_and_overall():
    rows = [
        {"dataset": "a", "scores": [1, 1], "finish_reasons": ["stop", "length"], "num_tokens": [3, 5]},
        {"dataset": "a", "scores": [0, 0], "finish_reasons": ["stop", "stop"], "num_tokens": [1, 1]},
        {"dataset": "b", "scores": [0, 1], "finish_reasons": ["stop", "stop"], "num_tokens": [2, 2]},
    ]
    m = compute_metrics(rows, [1, 2])
    assert list(m) == ["a", "b", "overall"]
    assert m["a"]["pass@1"] == pytest.approx(0.5) and m["a"]["pass@2"] == pytest.approx(0.5)
    assert m["b"]["pass@1"] == pytest.approx(0.5) and m["b"]["pass@2"] == pytest.approx(1.0)
    assert m["a"]["truncation_rate"] == pytest.approx(0.25) and m["a"]["response_length"] == pytest.approx(2.5)
    assert m["overall"]["pass@2"] == pytest.approx(0.75)  # mean over datasets, not over problems
    assert m["overall"]["num_problems"] == 3
    flat = flatten_metrics(m)
    assert flat["val/b/pass@2"] == 1.0 and flat["val/overall/pass@1"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dataset 'a'.*k=\\[3\\]"):
        compute_metrics(rows, [3])


def test_eval_doctests():
    import doctest

    import pacs_megatron.eval.passk as passk
    import pacs_megatron.eval.runner as runner

    for module in (passk, runner):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_boxed_rate_counts_non_empty_boxes():
    rows = [
        {"dataset": "d", "scores": [1.0, 1.0], "responses": ["so \\boxed{2}", "the answer is 2"]},
        {"dataset": "d", "scores": [0.0, 0.0], "responses": ["\\boxed{}", "\\boxed{3"]},
    ]
    m = compute_metrics(rows, [1])["d"]
    assert m["boxed_rate"] == 0.25 and m["mean@n"] == 0.5  # a right bare number counts as right, not as boxed
