"""vLLM on CPU through the user's commands: ``pacs-megatron eval --engine vllm`` (greedy answers equal the HF
engine's), and short training runs with ``rollout.engine=vllm`` on the CPU default (2 ranks under the
launcher, TP=2 actor over gloo): once with one vLLM TP=2 replica spanning both ranks, once with two TP=1
replicas. The post-sync probe (vLLM against the Megatron actor) must stay <= 1e-5 at every step."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from _runs import SHORT, metrics_rows, train_cmd
from _vllm import needs_vllm

from pacs_megatron.config import TinyModelConfig
from pacs_megatron.data.synthetic import tiny_qwen2_config
from pacs_megatron.tools import eval as cli

pytestmark = [needs_vllm, pytest.mark.slow]  # an engine starts: the slow tier


@pytest.mark.slow
def test_eval_engine_vllm_matches_the_hf_engine(data_root, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tmp_path / "model"
    model.mkdir()
    shape = TinyModelConfig(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1)
    shape.max_position_embeddings = 512
    (model / "config.json").write_text(json.dumps(tiny_qwen2_config(shape, 151665, eos_id=151645, pad_id=151643)))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model))).save_pretrained(str(model))
    argv = ["--model", str(model), "--tokenizer", str(data_root / "tokenizers" / "qwen2.5"), "--data", "math500"]
    argv += ["--limit", "2", "--n", "2", "--k", "1,2", "--max-tokens", "5", "--temperature", "0", "--device", "cpu"]
    argv += ["--reward-workers", "0"]
    answers = {}
    for engine in ("hf", "vllm"):
        parser = cli.argparse.ArgumentParser()
        cli.add_arguments(parser)
        out = tmp_path / engine
        assert cli.main(parser.parse_args([*argv, "--engine", engine, "--out", str(out)])) == 0
        rows = [json.loads(x) for x in (out / "eval_rollout.jsonl").read_text().splitlines()]
        answers[engine] = [r["responses"] for r in rows]
        assert json.loads((out / "eval_metrics.json").read_text())["math500"]["pass@1"] == 0.0
    assert len(answers["vllm"]) == 2 and answers["vllm"] == answers["hf"]
    assert "RANK" not in os.environ  # the one-rank launcher environment does not leak into later children


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("vllm_tp", [2, 1])
def test_short_training_run_with_vllm(tmp_path, vllm_tp):
    out = tmp_path / f"tp{vllm_tp}"
    cmd = train_cmd(out, 3, *SHORT, "rollout.engine=vllm", f"rollout.vllm.tensor_parallel_size={vllm_tp}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vLLM engine on cpu (float32)" in proc.stderr
    assert f"replica 0 of {2 // vllm_tp} (tp={vllm_tp})" in proc.stderr
    assert "Invalid process group" not in proc.stderr  # vLLM shut down before the trainer's teardown
    rows = metrics_rows(out)
    assert sorted(rows) == [1, 2, 3]
    for step, r in rows.items():
        assert r["sync/max_logprob_diff"] <= 1e-5, (step, r["sync/max_logprob_diff"])
        assert r["rollout/logprob_diff_max"] <= 1e-4, (step, r["rollout/logprob_diff_max"])
        assert 0.0 <= r["reward/mean"] <= 1.0
