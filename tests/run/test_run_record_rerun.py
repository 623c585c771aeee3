"""A start of a finished run leaves its final.json as the run wrote it, and a run's wall time counts from the
launch (issue 58, item 7). Old code: the re-run overwrote final.json with ``status: already_complete`` and its
own 2.8 s; a rank spawned by the launcher counted from its own start."""

from __future__ import annotations

import json
import logging
import time

import psutil

from pacs_megatron.config import load_config
from pacs_megatron.run.run_record import LAUNCH_TIME_ENV, RunRecord


def test_a_rerun_of_a_finished_run_keeps_its_final_json(tmp_path, caplog):
    cfg = load_config(None, [f"model.path={tmp_path}/m", f"trainer.output_dir={tmp_path}"])
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5, "timing/step_s": 60.0}) + "\n")
    RunRecord(cfg, tmp_path, True, None).finish(1, tmp_path / "checkpoints" / "step_00000001")
    written = (tmp_path / "final.json").read_text()
    assert json.loads(written)["status"] == "complete"
    with caplog.at_level(logging.INFO):
        s = RunRecord(cfg, tmp_path, True, None).finish(1, tmp_path / "ck", status="already_complete")
    assert (tmp_path / "final.json").read_text() == written, "the run's own record was replaced"
    assert s["status"] == "already_complete" and "run already complete at step 1" in caplog.text


def test_already_complete_writes_a_missing_final_json(tmp_path):
    cfg = load_config(None, [f"model.path={tmp_path}/m", f"trainer.output_dir={tmp_path}"])
    RunRecord(cfg, tmp_path, True, None).finish(1, None, status="already_complete")
    assert json.loads((tmp_path / "final.json").read_text())["status"] == "already_complete"


def test_wall_time_counts_from_the_launch(tmp_path, monkeypatch):
    cfg = load_config(None, [f"model.path={tmp_path}/m", f"trainer.output_dir={tmp_path}"])
    monkeypatch.setenv(LAUNCH_TIME_ENV, repr(time.time() - 100.0))  # the launcher started 100 s before this rank
    assert RunRecord(cfg, tmp_path, True, None).finish(0, None)["wall_time_s"] >= 100.0
    monkeypatch.delenv(LAUNCH_TIME_ENV)  # a rank of torchrun / srun: its own start (the suite's process may be old)
    own = time.time() - psutil.Process().create_time()
    assert own - 1.0 <= RunRecord(cfg, tmp_path, True, None).finish(0, None)["wall_time_s"] <= own + 5.0


def test_the_launch_counts_from_the_command_not_from_an_execing_shell(monkeypatch):
    """`bash -c "pip install ... && pacs-megatron train ..."` execs its last command, which keeps the shell's pid
    and start time: a fresh clone's run once reported 6m37s of wall time for a 3-minute launch. Old code
    (launch/cli.py) took the process's create time; the stand-in below is that shell, started 240 s ago."""
    from pacs_megatron.run.run_record import launch_time, mark_launch

    monkeypatch.delenv(LAUNCH_TIME_ENV, raising=False)
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: time.time() - 240.0)
    mark_launch()
    assert abs(launch_time() - time.time()) < 5.0
