"""Checkpoint directories: complete or invisible; pruning; resume resolution (validation stubbed:
these checkpoints hold text files; tests/utils/test_checkpoint_check.py writes real ones)."""

import pytest

from pacs_megatron.run.checkpoint import MARKER, CheckpointManager


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

    from pacs_megatron.run.checkpoint import CheckpointWriteError

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


def test_a_full_disk_inside_torch_distributed_checkpoint_is_one_line_too(tmp_path):
    """Issue 29 item 3: megatron's writer workers turn ENOSPC into text inside torch's CheckpointException,
    a BaseException: it escaped every ``except Exception`` (111 lines of traceback, one set per rank)."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from pacs_megatron.run.checkpoint import CheckpointWriteError

    mgr = CheckpointManager(tmp_path, validate=lambda p: None)
    enospc = RuntimeError("Worker failure: [Errno 28] No space left on device")
    pos = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    for failures, code in (({0: (enospc, None), 1: (pos, None)}, errno.ENOSPC), ({1: (pos, None)}, errno.ENOSPC)):

        def write(d, failures=failures):
            (d / "half").write_bytes(b"x" * 100)
            raise CheckpointException("write", failures)

        with pytest.raises(CheckpointWriteError, match=r"step 3 could not be written to .*ENOSPC .*metrics.jsonl") as e:
            mgr.save(3, write)
        assert e.value.errno == code and "\n" not in str(e.value)
        assert not list(mgr.root.glob(".tmp_step_*"))
    # the other ranks' view: torch gives them the exception without the failures; still one line
    with pytest.raises(CheckpointWriteError, match="a rank's writer failed"):
        mgr.save(3, lambda d: (_ for _ in ()).throw(CheckpointException("write", {})))
    with pytest.raises(KeyboardInterrupt):  # not a write failure: passes through
        mgr.save(3, lambda d: (_ for _ in ()).throw(KeyboardInterrupt()))


def test_the_first_checkpoint_is_checked_against_an_estimate(tmp_path):
    """Before any checkpoint exists, the free-space check uses ``first_size`` (the launcher's estimate)."""
    assert CheckpointManager(tmp_path, disk_free=lambda p: 4000).space_problem() is None  # no estimate: no check
    tight = CheckpointManager(tmp_path / "run", first_size=5000, disk_free=lambda p: 4000)
    assert "has 3.9 KiB free but a checkpoint takes about 4.9 KiB (estimated from the model's size)" in (
        tight.space_problem()
    )
