"""metrics.jsonl writing (with resume truncation) and PNG plots from it."""

import json

import pytest

from pacs_megatron.cli import main as cli_main
from pacs_megatron.config import ConfigError
from pacs_megatron.run.metrics import MetricsWriter
from pacs_megatron.tools.plot import read_metrics


def test_writer_truncates_on_resume_and_plot(tmp_path):
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    for s in range(1, 5):
        w.log(s, {"reward/mean": 0.1 * s, "pacs/loss": 0.7, "timing/step_s": float("nan")})
    w.truncate_after(2)  # resumed from the step-2 checkpoint
    w.log(3, {"reward/mean": 0.33})
    w.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["reward/mean"] == 0.33
    assert rows[0]["timing/step_s"] == "nan"
    assert any((tmp_path / "tb").iterdir())
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]

    assert cli_main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "plots" / "curves.png"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plot_two_runs_needs_out(tmp_path):
    for name in ("a", "b"):
        MetricsWriter(tmp_path / name, enabled=True, tensorboard=False).log(1, {"reward/mean": 0.5})
    assert cli_main(["plot", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    out = tmp_path / "cmp.png"
    assert cli_main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--keys", "reward/mean"]) == 0
    assert out.exists()
    with pytest.raises(ConfigError, match="trainer.output_dir"):
        read_metrics(tmp_path / "missing")


def test_a_restart_from_step_0_keeps_the_earlier_rows_aside(tmp_path, caplog):
    """Issue 29: ``--resume auto`` with no checkpoint restarts at step 0; it used to truncate metrics.jsonl
    (and rollouts.jsonl) without a word."""
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    for s in (1, 2, 3):
        w.log(s, {"reward/mean": 0.1 * s})
    (tmp_path / "rollouts.jsonl").write_text('{"step": 1, "text": "a"}\n')
    with caplog.at_level("WARNING", logger="pacs_megatron"):
        w.truncate_after(0)
    aside = list(tmp_path.glob("metrics.before-restart-*.jsonl"))
    assert len(aside) == 1 and len(aside[0].read_text().splitlines()) == 3
    assert len(list(tmp_path.glob("rollouts.before-restart-*.jsonl"))) == 1
    assert not (tmp_path / "metrics.jsonl").exists()
    assert "no checkpoint to resume from" in caplog.text and "up to step 3" in caplog.text
    w.log(1, {"reward/mean": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    w.truncate_after(-1)  # a fresh run's step-0 validation: nothing of a later step to keep
    assert len(list(tmp_path.glob("metrics.before-restart-*.jsonl"))) == 1


def test_a_mistyped_key_is_one_line_with_its_close_match(tmp_path, capsys):
    """Fails on the old code: ``--keys reward/meen`` said only that no requested key was present."""
    MetricsWriter(tmp_path, enabled=True, tensorboard=False).log(1, {"reward/mean": 0.5, "pacs/loss": 0.7})
    assert cli_main(["plot", str(tmp_path), "--keys", "reward/meen,pacs/loss"]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if " E " in ln]
    assert len(errors) == 1
    assert errors[0].endswith("--keys reward/meen: no such metric in the runs; did you mean reward/mean?")
    assert cli_main(["plot", str(tmp_path), "--keys", "reward/meen"]) == 2  # the command
    errors = [ln for ln in capsys.readouterr().err.splitlines() if " E " in ln]
    assert errors[0].endswith(
        "none of the requested metric keys is in the runs (reward/meen: did you mean reward/mean?)"
    )
    assert not (tmp_path / "plots").exists()
