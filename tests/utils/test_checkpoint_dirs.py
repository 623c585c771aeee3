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


def test_a_full_disk_is_named_in_one_line_and_checked_before_saving(tmp_path):
    import errno

    from pacs_megatron.utils.checkpoint import CheckpointWriteError

    mgr = CheckpointManager(tmp_path, validate=lambda p: None)

    def full(d):  # a real ENOSPC (/dev/full), re-raised as megatron's writers do
        try:
            with open("/dev/full", "wb") as fh:
                fh.write(b"x" * 4096)
                fh.flush()
        except OSError as e:
            raise RuntimeError("unexpected pos 704 vs 598") from e

    with pytest.raises(CheckpointWriteError, match=r"checkpoint step 3 could not be written to .*ENOSPC") as info:
        mgr.save(3, full)
    assert info.value.errno == errno.ENOSPC and "\n" not in str(info.value)
    assert not list(mgr.root.glob(".tmp_step_*"))  # the half-written checkpoint gave its space back

    mgr.save(4, lambda d: (d / "shard").write_bytes(b"x" * 5000))
    tight = CheckpointManager(tmp_path, validate=lambda p: None, disk_free=lambda p: 4000)
    assert "has 3.9 KiB free but a checkpoint takes about 4.9 KiB (the size of step_00000004)" in tight.space_problem()
    with pytest.raises(CheckpointWriteError, match="checkpoint step 5 not written: .* free but a checkpoint takes"):
        tight.save(5, lambda d: pytest.fail("must not start writing"))
    assert [s for s, _ in tight.complete()] == [4]
