"""bench/rl_step.py: the work it counts, the config it gives our trainer, and its report (no trainer runs)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import yaml

from pacs_megatron.bench import rl_step


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    path = tmp_path_factory.mktemp("llama") / "m"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path, LlamaForCausalLM(cfg)


def test_matmul_params_and_shapes(llama_dir):
    path, model = llama_dir
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert rl_step.matmul_params(str(path)) == linear  # every layer's linears + the (tied) LM head
    shapes = rl_step.gemm_shapes(str(path), 7)
    assert {(m, k, n) for m, k, n in shapes} >= {(7, 48, 48 + 2 * 16), (7, 48, 96), (7, 80, 48)}
    per_layer = sum(k * n for _, k, n in shapes[:4])
    assert 3 * per_layer + 48 * 96 == linear


def test_step_flops():
    # 10 prompt tokens in the step's distinct prompts, n=8: 80 prompt + 20 generated tokens
    assert rl_step.step_flops(1, tokens=100, prompt_tokens=10, n=8) == 2 * (10 + 20) + 6 * 100


def test_prompts_are_the_trainers_prompts(tmp_path):
    from pacs_megatron.data.prompts import render
    from pacs_megatron.data.sources import load_problems

    rows = rl_step.write_prompts(tmp_path / "p.jsonl", 5)
    problems = load_problems(tmp_path / "p.jsonl")
    assert [render(p, None, "none") for p in problems] == [r["prompt"] for r in rows]
    assert all(int(r["answer"]) == sum(int(x) for x in r["problem"][8:-1].split(" + ")) for r in rows)


@pytest.mark.parametrize("dp", [1, 2])
def test_our_config_is_valid(tmp_path, llama_dir, dp):
    from pacs_megatron.config import load_config

    args = argparse.Namespace(model=str(llama_dir[0]), prompts=8, n=8, max_tokens=48, lr=1e-5, steps=3,
                              loss="grpo", ours=[f"parallel.dp={dp}"])  # fmt: skip
    (tmp_path / "p.jsonl").write_text("")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(rl_step._ours_config(args, "bfloat16", tmp_path / "p.jsonl", tmp_path / "o")))
    cfg = load_config(str(cfg_file), args.ours)
    assert cfg.algorithm.micro_batch_size == 64 // dp and cfg.parallel.dp == dp and cfg.model.dtype == "bfloat16"
    assert cfg.algorithm.mini_batch_size == 0 and cfg.algorithm.old_logp_from_forward
    assert rl_step._layout(args.ours) == {"tp": 1, "pp": 1, "dp": dp}


def test_summary_and_report(capsys):
    from rich.console import Console

    def rec(trainer, step_s, tokens):
        r = {"step": 2, "tokens": tokens, "rank_tokens": tokens, "step_s": step_s, "step_cpu_s": 2 * step_s}
        r |= {f"{s}_s": step_s / 4 for s in rl_step.STAGES[trainer]}
        return r | {"peak_rss_gb": [3.0], "step_rss_gb": 1.0}

    flops_of = lambda tokens: rl_step.step_flops(1e8, tokens, 200, 8)  # noqa: E731
    rows = [
        rl_step.summarize([rec("ours", 10.0, 3000), rec("ours", 12.0, 3000)], "ours", "float32", flops_of, 1e11),
        rl_step.summarize([rec("trl", 40.0, 2800)], "trl", "float32", flops_of, 1e11),
    ]
    assert rows[0]["step_s"] == 11.0 and rows[0]["tokens_per_s"] == pytest.approx((300 + 250) / 2)
    assert rows[0]["floor_fraction"] == pytest.approx(flops_of(3000) / 11.0 / 1e11)
    assert rows[0]["bytes_per_token"] == pytest.approx(1e9 / 3000)
    rl_step.report(rows, {"float32": 1e11}, 1000, Console(file=None, width=250))
    out = capsys.readouterr().out
    assert "ours" in out and "trl" in out and "100 GFLOP/s" in out
    assert f"{rows[0]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}" in out
    json.dumps(rows)  # the --json report is plain data


def test_arms_name_our_trainer_once_per_switch_and_bad_arms_get_one_line():
    arms = rl_step.parse_arms(["fused:model.fused_lm_head=true", "unfused:model.fused_lm_head=false,rollout.n=4"])
    assert arms == {
        "ours/fused": ["model.fused_lm_head=true"],
        "ours/unfused": ["model.fused_lm_head=false", "rollout.n=4"],
    }
    assert rl_step.parse_arms([]) == {"ours": []}
    with pytest.raises(SystemExit, match="LABEL:a.b=c"):
        rl_step.parse_arms(["model.fused_lm_head=true"])  # the label is missing
    # an arm's row is summarized with our trainer's stages
    r = {"step": 2, "tokens": 100, "rank_tokens": 100, "step_s": 4.0, "step_cpu_s": 8.0}
    r |= {f"{s}_s": 1.0 for s in rl_step.STAGES["ours"]} | {"peak_rss_gb": [2.0], "step_rss_gb": 1.0}
    row = rl_step.summarize([r], "ours/fused", "float32", lambda t: 1e9, 1e11)
    assert set(row["stages_s"]) == set(rl_step.STAGES["ours"])
