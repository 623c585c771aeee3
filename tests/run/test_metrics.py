"""run/metrics.py: the console line of a logged row."""

from __future__ import annotations

import json
import logging

from pacs_megatron.run.metrics import MetricsWriter


def test_a_row_without_summary_keys_prints_no_empty_step_line(tmp_path, caplog):
    """Step 0 logs validation only; its sets have their own lines, so the old empty "step 0 | " is gone."""
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    with caplog.at_level(logging.INFO, logger="pacs_megatron"):
        writer.log(0, {"val/math/pass@1": 0.5})
        writer.log(1, {"reward/mean": 0.25, "val/math/pass@1": 0.5})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines == ["step 1 | reward=0.25"], lines
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # the file still has both rows
