"""metrics.jsonl writing (with resume truncation) and PNG plots from it."""

import json

import pytest

from pacs_megatron.cli import main as cli_main
from pacs_megatron.tools.plot import read_metrics
from pacs_megatron.utils.metrics import MetricsWriter


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
    with pytest.raises(FileNotFoundError, match="output_dir"):
        read_metrics(tmp_path / "missing")
