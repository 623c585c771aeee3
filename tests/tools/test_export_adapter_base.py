"""A LoRA export's adapter names its base by absolute path, and an adapter whose base has no weights on disk is
refused, pointing at ``--merge`` (issue 58, item 7). Old code: ``base_model_name_or_path`` was the run's relative
``model.path``, and a LoRA run of the CPU default (random init) exported an adapter of a base with no weights."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pacs_megatron.actor.lora.export import peft_config
from pacs_megatron.config import LoRAConfig
from pacs_megatron.tools.export import adapter_base_problem


def test_the_adapter_names_its_base_by_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 4)}
    config = peft_config(tensors, LoRAConfig(rank=2, alpha=4.0), "outputs/models/smol")
    assert config["base_model_name_or_path"] == str(tmp_path / "outputs" / "models" / "smol")
    assert os.path.isabs(config["base_model_name_or_path"])


def test_an_adapter_of_a_base_without_weights_is_refused(tmp_path):
    base = tmp_path / "m"
    base.mkdir()
    (base / "config.json").write_text("{}")
    tiny = {"config": {"model": {"init": "tiny"}}}
    problem = adapter_base_problem(tiny, str(base), Path("ck"))
    assert problem and "model.init=tiny drew them at random" in problem and problem.endswith("with --merge")
    pretrained = {"config": {"model": {"init": "pretrained"}}}
    assert "none found" in adapter_base_problem(pretrained, str(base), Path("ck"))
    (base / "model.safetensors").write_bytes(b"x")
    assert adapter_base_problem(pretrained, str(base), Path("ck")) is None
    assert adapter_base_problem({"config": {"model": {"init": "gguf"}}}, str(base), Path("ck")) is None
