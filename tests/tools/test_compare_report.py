"""``compare``'s table with one seed and one validation set (issue 42: it printed ``+- nan`` and the same
column twice)."""

from __future__ import annotations

from pacs_megatron.tools.compare_report import method_summary, table

ROWS = [{"step": s, "reward/mean": 0.1 * s, "val/arith/pass@1": 0.2 * s} for s in range(1, 5)]


def _summary(seeds: dict, tune_key: str) -> dict:
    val = "val/arith/pass@1"
    method = method_summary(seeds, val, tune_key) | {"lr": 1e-3}
    return {"val_key": val, "tune_key": tune_key, "methods": {"pacs": method}, "tuning": {}}


def test_one_seed_and_one_set_show_no_nan_and_no_duplicated_column():
    """Fails on the old code: ``0.600 +- nan`` and ``val/arith/pass@1`` in two columns."""
    text = table(_summary({0: ROWS}, "val/arith/pass@1"))
    assert "nan" not in text
    header = text.splitlines()[0]
    assert header == "| method | lr | seeds | val/arith/pass@1 | train reward/mean |"
    assert "| pacs | 0.001 | 1 | 0.600 | 0.400 |" in text
    assert "| pacs | 0 | 0.600 | 0.400 |" in text  # per seed
    assert all(ln.count("|") == header.count("|") for ln in text.splitlines()[:3] if ln.startswith("|"))


def test_two_seeds_and_a_separate_tuning_set_keep_both_columns_and_intervals():
    shifted = [r | {"val/tune/pass@1": r["val/arith/pass@1"] / 2} for r in ROWS]
    text = table(_summary({0: shifted, 1: [r | {"reward/mean": 0.0} for r in shifted]}, "val/tune/pass@1"))
    assert text.splitlines()[0] == "| method | lr | seeds | val/arith/pass@1 | val/tune/pass@1 | train reward/mean |"
    assert "+- " in text and "nan" not in text
