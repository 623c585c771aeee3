"""launch.json's launcher kind comes from the variables each launcher exports (no launcher import)."""

from __future__ import annotations

import json

import pytest

from pacs_megatron.run.launch_info import launcher_kind, write_launch_json

_VARS = ("PACS_LAUNCHER_KIND", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "RANK", "PACS_RAY_NODE_ID")


@pytest.mark.parametrize(
    ("env", "kind"),
    [
        ({}, "single"),
        ({"RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, "torchrun"),
        ({"RANK": "0", "SLURM_PROCID": "0"}, "slurm"),
        ({"RANK": "0", "SLURM_PROCID": "0", "PACS_LAUNCHER_KIND": "ray"}, "ray"),
    ],
)
def test_launcher_kind(monkeypatch, env, kind):
    for k in _VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launcher_kind() == kind


def test_write_launch_json_single_process(monkeypatch, tmp_path):
    for k in _VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PACS_RAY_NODE_ID", "abc")
    write_launch_json(tmp_path)
    info = json.loads((tmp_path / "launch.json").read_text())
    assert info["kind"] == "single" and info["world_size"] == 1
    (rank,) = info["ranks"]
    assert rank["rank"] == 0 and rank["local_rank"] == 0 and rank["node_id"] == "abc" and rank["host"]
