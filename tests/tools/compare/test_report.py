"""``compare``'s table with one seed and one validation set (issue 42: it printed ``+- nan`` and the same
column twice)."""

from __future__ import annotations

from pacs_megatron.tools.compare.report import method_summary, table

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


def test_pass_at_k_finals_and_the_classifier_curves(tmp_path):
    """The held-out split's pass@4/16 get their own intervals, and entropy / psi curves are kept and drawn."""
    from pacs_megatron.tools.compare.report import plot

    rows = [
        r | {"val/arith/pass@4": 0.5, "val/arith/pass@16": 0.75, "actor/entropy": 1.0 - 0.1 * r["step"],
             "pacs/post_psi_abs_mean": 0.01 * r["step"]}
        for r in ROWS
    ]  # fmt: skip
    summary = _summary({0: rows, 1: rows}, "val/arith/pass@1") | {"seeds": 2}
    method = summary["methods"]["pacs"]
    assert list(method["final_pass_at_k"]) == ["val/arith/pass@4", "val/arith/pass@16"]
    assert method["final_pass_at_k"]["val/arith/pass@16"]["mean"] == 0.75
    assert (
        method["curves"]["actor/entropy"]["mean"] == [0.9, 0.8, 0.7, 0.6] and "pacs/post_brier" not in method["curves"]
    )
    text = table(summary)
    assert (
        "| method | val/arith/pass@4 | val/arith/pass@16 |" in text
        and "| pacs | 0.500 +- 0.000 | 0.750 +- 0.000 |" in text
    )
    assert plot(summary, tmp_path / "c.png").stat().st_size > 0


def test_the_curves_say_how_many_seeds_finished(tmp_path, monkeypatch):
    """The plot's titles count the seeds that finished, not the protocol's planned ones (issue 56's curves said
    "over 6 seeds" with 2 of 6 finished)."""
    from pacs_megatron.tools.compare import report

    titles = []
    monkeypatch.setattr(report, "finish", lambda ax, title, xlabel: titles.append(title))
    summary = _summary({0: ROWS, 1: ROWS}, "val/arith/pass@1") | {"seeds": 6}
    report.plot(summary, tmp_path / "c.png")
    assert titles and all(t.endswith("over 2 of 6 seeds") for t in titles)
