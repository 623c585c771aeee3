"""Checkpoint validation on real torch_dist files: the three damages of issue 13 (a deleted shard, a
deleted extra_state.json, a truncated shard), and what resume and pruning do with a damaged one."""

import json
import shutil
import warnings

import pytest
import torch

from pacs_megatron.utils.checkpoint import MARKER, CheckpointManager
from pacs_megatron.utils.checkpoint_check import checkpoint_problem, parameter_dtype


def _write_checkpoint(d, step: int) -> None:
    """A checkpoint laid out as actor/checkpoint.py writes one (torch_dist shards + common state)."""
    import torch.distributed.checkpoint as dcp

    meg = d / "megatron"
    meg.mkdir(parents=True)
    state = {"embedding.word_embeddings.weight": torch.randn(64, 16), "decoder.w": torch.randn(300)}
    with warnings.catch_warnings():  # "no process group": the single-process path is what we want
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(meg))
    torch.save({"scheduler": {"num_steps": step}, "layout": {"tp": 1, "pp": 1}}, meg / "common.pt")
    (meg / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (d / "extra_state.json").write_text(json.dumps({"step": step, "dataset": {"position": 0}}))


def _save(mgr: CheckpointManager, step: int):
    return mgr.save(step, lambda d, s=step: _write_checkpoint(d, s))


def test_three_damages_are_named(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    for step in (1, 2, 3, 4):
        _save(mgr, step)
    assert all(checkpoint_problem(p) is None for _, p in mgr.complete())
    assert parameter_dtype(mgr.step_dir(1)) == torch.float32
    shards = sorted((mgr.step_dir(2) / "megatron").glob("*.distcp"))
    assert shards
    shards[0].unlink()
    (mgr.step_dir(3) / "extra_state.json").unlink()
    shard = sorted((mgr.step_dir(4) / "megatron").glob("*.distcp"))[0]
    with shard.open("r+b") as fh:
        fh.truncate(100)
    assert checkpoint_problem(mgr.step_dir(2)) == f"shard megatron/{shards[0].name} is missing"
    assert checkpoint_problem(mgr.step_dir(3)) == "extra_state.json is missing"
    assert "truncated (100 of" in checkpoint_problem(mgr.step_dir(4))
    (mgr.step_dir(1) / "megatron" / "common.pt").write_bytes(b"not a pickle")
    assert "common state is unreadable" in checkpoint_problem(mgr.step_dir(1))


def test_resume_falls_back_and_moves_damaged_aside(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        _save(mgr, step)
    assert [s for s, _ in mgr.complete()] == [2, 3]
    (mgr.step_dir(3) / "extra_state.json").unlink()
    # An explicit path names the damage and the way out; nothing is moved.
    with pytest.raises(FileNotFoundError, match="extra_state.json is missing.*trainer.resume=auto"):
        mgr.resolve(str(mgr.step_dir(3)))
    with caplog.at_level("WARNING"):
        assert mgr.resolve("auto") == mgr.step_dir(2)
    assert "extra_state.json is missing" in caplog.text and "corrupt_step_00000003" in caplog.text
    corrupt = mgr.root / "corrupt_step_00000003"
    assert corrupt.is_dir() and (corrupt / MARKER).is_file()  # kept, never deleted
    # Pruning keeps 2 *valid* checkpoints: a damaged newest one never costs the older good one.
    _save(mgr, 4)
    shard = sorted((mgr.step_dir(4) / "megatron").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:10])
    _save(mgr, 5)
    assert [s for s, _ in mgr.complete()] == [2, 5]
    assert sorted(p.name for p in mgr.root.iterdir()) == [
        "corrupt_step_00000003",
        "corrupt_step_00000004",
        "step_00000002",
        "step_00000005",
    ]
    # A second damaged step 3 does not overwrite the first one moved aside.
    shutil.copytree(corrupt, mgr.step_dir(3))
    assert mgr.resolve("auto") == mgr.step_dir(5)
    _save(mgr, 6)
    assert (mgr.root / "corrupt_step_00000003.1").is_dir()
    assert [s for s, _ in mgr.complete()] == [5, 6]
