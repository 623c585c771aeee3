"""The K sweep's table: the Brier by the reference's age over seeds, and per K, from compare --results folders."""

from __future__ import annotations

import json

import pytest

from pacs_megatron.tools.reference_age import by_age, k_table, load_sweep, main


def _run(root, k, seed, briers, val=0.5):
    """A run of ``len(briers)`` steps at reset period K (0: never), its Brier at each step, validated at its end."""
    d = root / f"K{k}" / "runs" / f"pacs_v2_lr0.0003_s{seed}-abc"
    d.mkdir(parents=True)
    rows = []
    for step, b in enumerate(briers, start=1):
        age = (step - 1) % k if k else step - 1  # the age of the reference the step's update used
        rows.append({"step": step, "reference/age": age, "pacs/brier": b, "pacs/post_brier": b / 2, "reward/mean": 0.5})
    rows[-1]["val/arith/pass@1"] = val
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_brier_by_age_averages_each_seed_first_then_takes_the_interval(tmp_path):
    _run(tmp_path, 2, 0, [0.25, 0.20, 0.23, 0.19])  # ages 0 1 0 1
    _run(tmp_path, 2, 1, [0.25, 0.22, 0.25, 0.20])
    _run(tmp_path, 0, 0, [0.25, 0.21, 0.18, 0.24], val=0.7)  # never reset: ages 0 1 2 3
    sweep = load_sweep(tmp_path)
    assert list(sweep) == [2, 0] and len(sweep[2]) == 2
    t = by_age(sweep[2], "pacs/brier")
    assert t[0]["mean"] == pytest.approx((0.24 + 0.25) / 2) and t[0]["n"] == 2
    assert t[1]["mean"] == pytest.approx((0.195 + 0.21) / 2)
    assert list(by_age(sweep[0], "pacs/brier")) == [0, 1, 2, 3]
    md = k_table(sweep)
    assert "| never | 1 | 0.220 | 0.110 | 0.500 | 0.700 |" in md
    assert "| 3 |  | 0.240 |" in md  # age 3 only in the run that never reset (columns: K 2, K never)


def test_main_writes_the_table_and_the_plot_and_refuses_an_empty_folder(tmp_path, capsys):
    _run(tmp_path, 5, 0, [0.25, 0.2, 0.2])
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "k_table.md").is_file() and (tmp_path / "out" / "brier_by_age.png").stat().st_size > 5000
    with pytest.raises(SystemExit):
        main([str(tmp_path / "none"), "--out", str(tmp_path / "o")])
    assert "run examples/k_sweep_cpu.sh first" in capsys.readouterr().err
