"""A disk that fills at the first checkpoint (issue 29 item 3, for real: a tmpfs with room for the
run's estimate at launch but not for the checkpoint it writes): one line from rank 0 naming the
directory and ENOSPC and where the steps so far are, no traceback, the metrics of every step kept."""

from __future__ import annotations

import subprocess

import pytest
from _bad_inputs import small_disk
from _runs import SHORT, metrics_rows, train_cmd

from pacs_megatron.config import load_config
from pacs_megatron.launch.checks.preflight import checkpoint_bytes


@pytest.mark.slow
@pytest.mark.distributed
def test_a_full_disk_at_the_first_checkpoint_is_one_line(tmp_path):
    cmd = train_cmd(tmp_path / "disk" / "run", 2, *SHORT, "trainer.save_freq=2")
    cfg = load_config(cmd[5], cmd[6:])
    room = checkpoint_bytes(cfg) // 1024 + 64  # KiB: the launch estimate fits, the real checkpoint does not
    with small_disk(tmp_path / "disk", f"{room}k") as disk:
        if disk is None:
            pytest.skip("needs root to mount a small tmpfs")
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        out = disk / "run"
        log = res.stdout + res.stderr
        assert res.returncode == 1, log[-3000:]
        assert "Traceback" not in log and "CheckpointException" not in log, log[-3000:]
        rank0 = [ln for ln in log.splitlines() if " r0 E " in ln]
        assert len(rank0) == 2, rank0  # the error, and the spawner's "a rank exited"
        assert f"checkpoint step 2 could not be written to {out}/checkpoints/.tmp_step_00000002: ENOSPC" in rank0[0]
        assert "metrics.jsonl" in rank0[0]
        assert sorted(metrics_rows(out)) == [1, 2]  # nothing already computed is lost
        assert not list((out / "checkpoints").glob(".tmp_step_*"))  # the partial checkpoint gave its space back
