"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

For a problem with ``n`` samples of which ``c`` are correct, the probability that a uniformly random
subset of ``k`` samples holds at least one correct one is ``1 - C(n-c, k) / C(n, k)``. The ratio of
binomials is evaluated as the product ``prod_{i=n-c+1}^{n} (1 - k / i)``, which never forms the huge
binomials (exact up to float round-off for any n). Per-problem values are averaged per dataset.
``mean@n`` is the plain average score over all n samples (the expected pass@1).
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that k of the n samples (c correct) contain a correct one.

    Example:
        >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 0, 4), pass_at_k(4, 3, 2)
        (0.25, 0.5, 0.0, 1.0)
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} correct must be in 0..n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in 1..n={n} (sample at least k responses per problem)")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def problem_metrics(scores: Sequence[float], k_list: Sequence[int], threshold: float = 0.5) -> dict[str, float]:
    """pass@k for each k and mean@n of one problem's sample scores (correct: score > threshold).

    Example:
        >>> problem_metrics([1.0, 0.0, 0.0, 1.0], [1, 2])
        {'pass@1': 0.5, 'pass@2': 0.8333333333333333, 'mean@n': 0.5}
    """
    n = len(scores)
    c = sum(1 for s in scores if s > threshold)
    out = {f"pass@{k}": pass_at_k(n, c, k) for k in k_list}
    out["mean@n"] = sum(float(s) for s in scores) / n
    return out


def dataset_metrics(per_problem_scores: Sequence[Sequence[float]], k_list: Sequence[int]) -> dict[str, float]:
    """Problem-averaged pass@k and mean@n of one dataset, plus ``n`` and ``num_problems``.

    All problems must have the same number of samples (pass@k of different n would not average
    into one estimator of the same quantity).
    """
    if not per_problem_scores:
        raise ValueError("dataset_metrics: no problems")
    ns = {len(s) for s in per_problem_scores}
    if len(ns) != 1:
        raise ValueError(f"dataset_metrics: problems have different sample counts {sorted(ns)}")
    (n,) = ns
    bad = [k for k in k_list if not 1 <= k <= n]
    if bad:
        raise ValueError(f"k={bad} exceed the n={n} samples per problem: use k <= n")
    totals: dict[str, float] = {}
    for scores in per_problem_scores:
        for key, v in problem_metrics(scores, k_list).items():
            totals[key] = totals.get(key, 0.0) + v
    out = {key: v / len(per_problem_scores) for key, v in totals.items()}
    out["n"] = float(n)
    out["num_problems"] = float(len(per_problem_scores))
    return out
