"""Checkpoint validation on real torch_dist files: the three damages of issue 13 (a deleted shard, a
deleted extra_state.json, a truncated shard), what resume and pruning do with a damaged one, and a
tampered checkpoint (issue 33: a pickle that runs code) refused by every path that reads one."""

import argparse
import json
import pickle
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from pacs_megatron.run.checkpoint import MARKER, CheckpointManager
from pacs_megatron.run.checkpoint_check import checkpoint_problem, parameter_dtype


def _write_checkpoint(d, step: int, common: dict | None = None, objects: dict | None = None, meg: str = "megatron"):
    """A checkpoint laid out as actor/checkpoint.py writes one (torch_dist shards + common state in
    ``d/meg``); ``objects`` are pickled into the shards as byte items, as megatron writes its ShardedObjects."""
    import torch.distributed.checkpoint as dcp

    meg = d / meg
    meg.mkdir(parents=True)
    state = {"embedding.word_embeddings.weight": torch.randn(64, 16), "decoder.w": torch.randn(300)}
    with warnings.catch_warnings():  # "no process group": the single-process path is what we want
        warnings.simplefilter("ignore")
        dcp.save(state | (objects or {}), checkpoint_id=str(meg))
    common = {"scheduler": {"num_steps": step}, "layout": {"tp": 1, "pp": 1}} | (common or {})
    torch.save(common, meg / "common.pt")
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


class _Plant:
    """Unpickled, this writes ``marker``: the side effect of a tampered checkpoint (any code could run)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _tampered(tmp_path, where: str):
    """A complete step_00000002 whose ``where`` (common.pt, .metadata, a shard's byte item, the critic's
    or the reference policy's common.pt) carries a _Plant, after a valid step_00000001; returns
    (manager, marker)."""
    marker = tmp_path / f"ran_{where.strip('.')}"
    mgr = CheckpointManager(tmp_path / "run", keep_last=0, validate=lambda p: None)  # writing checks nothing
    _save(mgr, 1)
    if where == "common.pt":
        mgr.save(2, lambda d: _write_checkpoint(d, 2, common={"layout": {"tp": 1, "x": _Plant(marker)}}))
    elif where == "object":  # an RNG state as megatron saves it: a pickled object inside a .distcp shard
        mgr.save(2, lambda d: _write_checkpoint(d, 2, objects={"rng_state": [_Plant(marker)]}))
    elif where in ("critic", "reference"):  # a PPO critic / KL reference policy saved beside the actor

        def write(d):
            _write_checkpoint(d, 2)
            if where == "critic":
                _write_checkpoint(d / "critic", 2, common={"x": _Plant(marker)})
            else:
                _write_checkpoint(d, 2, common={"x": _Plant(marker)}, meg="reference")

        mgr.save(2, write)
    else:
        _save(mgr, 2)
        meta = mgr.step_dir(2) / "megatron" / ".metadata"
        with meta.open("rb") as f:
            metadata = pickle.load(f)
        metadata.planner_data = _Plant(marker)
        meta.write_bytes(pickle.dumps(metadata))
    assert not marker.exists()
    return CheckpointManager(tmp_path / "run", keep_last=0), marker


@pytest.mark.parametrize("where", ["common.pt", ".metadata", "object", "critic", "reference"])
def test_tampered_checkpoint_is_refused_and_runs_nothing(tmp_path, caplog, where):
    mgr, marker = _tampered(tmp_path, where)
    tampered = mgr.step_dir(2)
    problem = checkpoint_problem(tampered)  # the resume check, pruning, export's first step
    assert not marker.exists(), f"checking {where} ran its code"
    assert problem and "builtins.exec" in problem and "\n" not in problem, problem
    with pytest.raises(FileNotFoundError, match="builtins.exec"):  # resume from an explicit path
        mgr.resolve(str(tampered))
    if where == ".metadata":  # export's dtype lookup reads .metadata itself
        with pytest.raises(ValueError, match="builtins.exec"):
            parameter_dtype(tampered)
    if where == "common.pt":  # export's layout lookup reads common.pt itself
        from pacs_megatron.run.checkpoint_data import load_common

        with pytest.raises(ValueError, match="builtins.exec"):
            load_common(tampered / "megatron")
    with caplog.at_level("WARNING"):  # the fallback scan: moved aside, the older one resumes
        assert mgr.resolve("auto") == mgr.step_dir(1)
    assert "builtins.exec" in caplog.text
    assert not marker.exists(), f"unpickling {where} ran its code"


@pytest.mark.subprocess
def test_export_refuses_a_tampered_checkpoint_in_one_line(tmp_path):
    mgr, marker = _tampered(tmp_path, "common.pt")
    cmd = [sys.executable, "-m", "pacs_megatron", "export", str(mgr.step_dir(2)), str(tmp_path / "hf")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "builtins.exec" in lines[0], proc.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()
    from pacs_megatron.tools.export import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "load only checkpoints you trust" in " ".join(parser.format_help().split())  # the trust boundary
