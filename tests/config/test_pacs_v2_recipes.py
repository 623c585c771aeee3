"""The PACS v2 recipes: the Qwen3-4B / 8B GPU recipes pass ``--dry-run`` and ``doctor`` with the paper's
setup and evaluation settings (their models' config.json stand in for the weights, BeyondAIME comes from a
path), and the SmolLM2 CPU recipes are v1 with four mini-batches and v2 anchored on a reset reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pacs_megatron.cli import main
from pacs_megatron.config import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"
# config.json fields the layout and memory plan read (the published Qwen3 configs)
QWEN3 = {
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=9728, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=12288, tie_word_embeddings=False),
}  # fmt: skip


@pytest.mark.parametrize("size", ["4b", "8b"])
def test_qwen3_v2_recipes_dry_run_and_doctor(size, data_root, tmp_path, monkeypatch, capsys, vllm_installed):
    model = tmp_path / f"Qwen3-{size}"
    model.mkdir()
    hf = dict(QWEN3[size], model_type="qwen3", vocab_size=151936, head_dim=128, max_position_embeddings=40960)
    (model / "config.json").write_text(json.dumps(hf))
    save_file({"stand_in": torch.zeros(1)}, str(model / "model.safetensors"))  # the preflight wants weights there
    beyond = tmp_path / "beyond_aime.jsonl"
    beyond.write_text(json.dumps({"id": "b-1", "problem": "What is 1 + 1?", "answer": "2", "source": "b"}) + "\n")
    monkeypatch.setenv("BEYOND_AIME_JSONL", str(beyond))
    # the 8B checkpoint (~107 GiB) needs a bigger disk than this machine's: the preflight's room check sees one
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=2**41))
    recipe = str(CONFIGS / f"qwen3_{size}_pacs_v2.yaml")
    tokenizer = data_root / "tokenizers" / "qwen2.5"  # Qwen3 keeps Qwen2.5's BPE vocabulary
    over = [f"model.path={model}", f"model.tokenizer={tokenizer}", f"trainer.output_dir={tmp_path / 'out'}"]

    cfg = load_config(recipe, over)
    a, t = cfg.algorithm, cfg.trainer
    assert (a.loss, a.pacs.anchor, a.pacs.beta, a.pacs.adv_estimator, a.kl_loss_coef) == (
        "pacs",
        "reference",
        1.0,
        "rloo",
        0,
    )
    assert a.reference_reset_every > 0 and a.needs_reference
    assert (t.train_batch_size, a.mini_batch_size, a.micro_batch_size, cfg.rollout.n) == (1024, 256, 8, 8)
    assert (cfg.optimizer.lr, cfg.data.max_prompt_length, cfg.rollout.max_response_length) == (1e-6, 1024, 8192)
    assert t.total_steps == {"4b": 120, "8b": 320}[size]
    assert (t.val_temperature, t.val_top_p, t.val_n) == (0.6, 0.95, 128)
    assert cfg.data.val_files == ["math500", "amc23", "aime2024", "aime2025", str(beyond)]

    assert main(["train", "--config", recipe, "--dry-run", *over]) == 0
    assert "anchor: reference" in capsys.readouterr().out
    code = main(["doctor", "--json", "--config", recipe, *over, "--gpu-gib", "80"])
    report = json.loads(capsys.readouterr().out)
    assert "config_error" not in report and report["layout"]["dp"] * report["layout"]["tp"] == 8
    assert report["memory"]["fits"] and report["memory"]["reference_gib"] == 0.0  # offloaded to the host
    vllm_missing = not any(r["module"] == "vllm" and r["imports"] for r in report["stack"])
    assert code == (1 if vllm_missing else 0)


def test_qwen3_8b_v2_16k_recipe_plans_context_parallelism(data_root, tmp_path, monkeypatch, capsys, vllm_installed):
    """16k-token responses on 8 x 80 GB: TP = 4 x CP = 2 passes --dry-run and doctor (issue 61, item 7)."""
    model = tmp_path / "Qwen3-8b"
    model.mkdir()
    hf = dict(QWEN3["8b"], model_type="qwen3", vocab_size=151936, head_dim=128, max_position_embeddings=40960)
    (model / "config.json").write_text(json.dumps(hf))
    save_file({"stand_in": torch.zeros(1)}, str(model / "model.safetensors"))
    monkeypatch.setenv("BEYOND_AIME_JSONL", str(tmp_path / "beyond_aime.jsonl"))
    (tmp_path / "beyond_aime.jsonl").write_text(json.dumps({"id": "b", "problem": "1 + 1?", "answer": "2"}) + "\n")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=2**41))
    recipe = str(CONFIGS / "qwen3_8b_pacs_v2_16k.yaml")
    tokenizer = data_root / "tokenizers" / "qwen2.5"
    over = [f"model.path={model}", f"model.tokenizer={tokenizer}", f"trainer.output_dir={tmp_path / 'out'}"]
    cfg = load_config(recipe, over)
    assert (cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.dp, cfg.parallel.world_size) == (4, 2, 1, 8)
    assert cfg.rollout.max_response_length == 16384 and cfg.algorithm.pacs.anchor == "reference"
    assert main(["train", "--config", recipe, "--dry-run", *over]) == 0
    capsys.readouterr()
    main(["doctor", "--json", "--config", recipe, *over, "--gpu-gib", "80"])
    report = json.loads(capsys.readouterr().out)
    assert "config_error" not in report and report["layout"]["cp"] == 2 and report["memory"]["fits"]
    # without CP the same run does not fit: TP = 8 needs more than 80 GiB less the headroom
    main(["doctor", "--json", "--config", recipe, *over, "parallel.tp=8", "parallel.cp=1", "--gpu-gib", "80"])
    assert not json.loads(capsys.readouterr().out)["memory"]["fits"]


def test_smollm2_v1_and_v2_recipes():
    v1 = load_config(str(CONFIGS / "cpu_smollm2_pacs_v1.yaml"), [])
    v2 = load_config(str(CONFIGS / "cpu_smollm2_pacs_v2.yaml"), [])
    for cfg in (v1, v2):  # the paper's 4 updates per rollout batch (1024 / 256)
        assert cfg.trainer.train_batch_size // cfg.mini_batch_prompts == 4 and cfg.algorithm.loss == "pacs"
    assert v1.algorithm.pacs.anchor == "old" and not v1.algorithm.needs_reference
    assert v2.algorithm.pacs.anchor == "reference" and v2.algorithm.reference_reset_every > 0
