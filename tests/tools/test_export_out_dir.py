"""``export CKPT OUT`` refuses a non-empty OUT that is not an earlier export of the same run (issue 42, FAIL 2:
it wrote its config.json over another model's and left that model's pytorch_model.bin beside the new weights)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import pacs_megatron.tools.export as export
from pacs_megatron.config import ConfigError


class _Planned(Exception):
    """Raised where _plan goes on to read the checkpoint: OUT_DIR was accepted."""


def _args(ckpt: Path, out: Path, overwrite: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    export.add_arguments(p)
    return p.parse_args([str(ckpt), str(out), *(["--overwrite"] if overwrite else [])])


@pytest.fixture
def plan(monkeypatch, tmp_path):
    """_plan with a stand-in checkpoint (run/checkpoints/step_00000003) that stops once OUT_DIR passed."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    ckpt.mkdir(parents=True)
    monkeypatch.setattr(export, "_checkpoint_dir", lambda path: Path(path))

    def stop(_ckpt):
        raise _Planned

    monkeypatch.setattr(export, "read_extra_state", stop)
    return ckpt


def _other_model(out: Path) -> None:
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "llama"}')
    (out / "pytorch_model.bin").write_bytes(b"weights of another model")


def test_a_directory_holding_another_model_is_refused_naming_overwrite(plan, tmp_path):
    """Fails on the old code: _plan accepted the directory (and the export overwrote its config.json)."""
    out = tmp_path / "base_model"
    _other_model(out)
    with pytest.raises(ConfigError) as e:
        export._plan(_args(plan, out))
    line = str(e.value)
    assert "not empty" in line and "--overwrite" in line and "pytorch_model.bin" in line and "\n" not in line
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'  # untouched
    with pytest.raises(_Planned):  # asked for: accepted
        export._plan(_args(plan, out, overwrite=True))


def test_absent_empty_and_own_earlier_exports_are_accepted(plan, tmp_path):
    for out in (tmp_path / "new", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        with pytest.raises(_Planned):
            export._plan(_args(plan, out))
    again = tmp_path / "again"
    again.mkdir()
    (again / "model.safetensors").write_bytes(b"x")
    (again / export.RECORD).write_text(json.dumps({"run": str((tmp_path / "run").resolve())}))
    with pytest.raises(_Planned):  # an earlier export of this same run: replaced without --overwrite
        export._plan(_args(plan, again))
    (again / export.RECORD).write_text(json.dumps({"run": "/elsewhere/run"}))
    with pytest.raises(ConfigError, match=r"an export of another run \(/elsewhere/run\).*--overwrite"):
        export._plan(_args(plan, again))


def test_overwriting_leaves_no_weights_of_the_old_model(tmp_path):
    out = tmp_path / "base_model"
    _other_model(out)
    (out / "model-00001-of-00002.safetensors").write_bytes(b"x")
    (out / "model.safetensors.index.json").write_text("{}")
    (out / "README.md").write_text("kept")
    assert export.clear_weights(out) == [
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
    ]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json"]
