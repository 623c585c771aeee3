"""Checkpoint directories: complete or invisible; pruning; resume resolution (validation stubbed:
these checkpoints hold text files; tests/utils/test_checkpoint_check.py writes real ones)."""

import pytest

from pacs_megatron.utils.checkpoint import MARKER, CheckpointManager


def test_save_latest_prune_and_half_written(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, validate=lambda p: None)
    assert mgr.latest() is None and mgr.resolve("auto") is None
    for step in (1, 2, 3):
        mgr.save(step, lambda d, s=step: (d / "state.txt").write_text(str(s)))
    assert [s for s, _ in mgr.complete()] == [2, 3]
    assert (mgr.latest() / "state.txt").read_text() == "3"
    # A crash mid-write leaves a .tmp dir and a step dir without marker: neither is picked up.
    (mgr.root / ".tmp_step_00000004").mkdir()
    (mgr.root / "step_00000005").mkdir()
    assert mgr.latest() == mgr.step_dir(3)
    assert mgr.resolve("never") is None
    with pytest.raises(FileNotFoundError, match=MARKER):
        mgr.resolve(str(mgr.root / "step_00000005"))
    # The next save clears the leftovers of the crashed one.
    mgr.save(6, lambda d: None)
    assert not (mgr.root / ".tmp_step_00000004").exists()


def test_failed_write_leaves_no_complete_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, validate=lambda p: None)

    def boom(d):
        (d / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError):
        mgr.save(7, boom)
    assert mgr.latest() is None
