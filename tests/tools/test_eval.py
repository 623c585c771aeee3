"""The ``pacs-megatron eval`` command end to end on CPU with a tiny random Qwen2 and the shared Qwen2.5
tokenizer (the library entry with a scripted engine: tests/eval/test_eval_runner.py)."""

import json

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from pacs_megatron.cli import main
from pacs_megatron.config import TinyModelConfig
from pacs_megatron.data.synthetic import tiny_qwen2_config


def _run(**kw) -> int:
    """``pacs-megatron eval --key value ...`` through the CLI (its error boundary included)."""
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return main(["eval", *argv])


@pytest.fixture(scope="module")
def qwen_tiny_dir(tmp_path_factory, data_root):
    """A tiny random Qwen2 (config.json + weights) over the shared Qwen2.5 tokenizer's vocabulary; eval refuses
    a model directory without weights (issue 29: it used to score a random initialisation)."""
    path = tmp_path_factory.mktemp("qwen_tiny")
    tiny = TinyModelConfig(hidden_size=16, num_layers=1, num_attention_heads=2, num_key_value_heads=1)
    cfg = tiny_qwen2_config(tiny, 151665, eos_id=151645, pad_id=151643)
    (path / "config.json").write_text(json.dumps(cfg))
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path))).save_pretrained(str(path))  # random weights
    return path


@pytest.mark.subprocess
def test_eval_cli_end_to_end_and_recompute(qwen_tiny_dir, data_root, tmp_path, capsys):
    out = tmp_path / "out"
    tokenizer = data_root / "tokenizers" / "qwen2.5"
    common = dict(data="math500,amc23", n=2, k="1,2", limit=2, reward_workers=0, out=out)
    rc = _run(model=qwen_tiny_dir, tokenizer=tokenizer, max_tokens=4, temperature=0, seed=1, **common)
    assert rc == 0
    rows = [json.loads(line) for line in (out / "eval_rollout.jsonl").read_text().splitlines()]
    first_ids = {
        name: [json.loads(line)["id"] for line in (data_root / "eval" / f"{name}.jsonl").read_text().splitlines()[:2]]
        for name in ("math500", "amc23")
    }
    assert [(r["dataset"], r["id"]) for r in rows] == [(d, i) for d in ("math500", "amc23") for i in first_ids[d]]
    for r in rows:
        assert {"id", "dataset", "problem", "prompt", "answer", "responses", "scores"} <= set(r)
        assert len(r["responses"]) == 2 and len(r["scores"]) == 2
        assert all(s == 0.0 for s in r["scores"])  # a random model does not solve competition math
        assert r["prompt"].startswith("<|im_start|>system\n") and r["prompt"].endswith("<|im_start|>assistant\n")
        assert r["problem"] in r["prompt"] and "\\boxed{}" in r["prompt"]
        assert all(n <= 4 for n in r["num_tokens"])
        assert r["responses"][0] == r["responses"][1]  # --temperature 0 is greedy
        assert r["data_source"] == r["dataset"] and r["output"] == r["responses"] and r["score"] == r["scores"]
    metrics = json.loads((out / "eval_metrics.json").read_text())
    assert set(metrics) == {"math500", "amc23", "overall", "sampling"}
    assert metrics["math500"]["pass@1"] == 0.0 and metrics["amc23"]["num_problems"] == 2
    assert {"pass@1", "pass@2", "mean@n"} <= set(metrics["overall"])
    sampled = metrics["sampling"]
    assert (sampled["n"], sampled["temperature"], sampled["max_tokens"], sampled["seed"]) == (2, 0.0, 4, 1)
    assert sampled["data"] == ["math500", "amc23"] and sampled["model"] == str(qwen_tiny_dir.resolve())

    # Same settings again: the cached rollouts are reused, only the metrics are recomputed.
    for r, scores in zip(rows, ([1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0])):
        r["scores"] = scores
    (out / "eval_rollout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    same = dict(model=qwen_tiny_dir, tokenizer=tokenizer, max_tokens=4, temperature=0, seed=1, **common)
    assert _run(**same) == 0
    assert "sampled with these settings: recomputing metrics only" in capsys.readouterr().err
    metrics = json.loads((out / "eval_metrics.json").read_text())
    assert metrics["math500"]["pass@1"] == pytest.approx(0.25) and metrics["math500"]["pass@2"] == pytest.approx(0.5)
    assert metrics["amc23"]["pass@1"] == pytest.approx(0.75) and metrics["amc23"]["pass@2"] == pytest.approx(1.0)
    assert metrics["overall"]["pass@2"] == pytest.approx(0.75)

    # Another n: sampled anew, saying why (a model dir without config.json stops it right after).
    other = dict(same, model=tmp_path / "no_model", n=4)
    assert _run(**other) == 2
    err = capsys.readouterr().err
    assert "sampling anew" in err and "n: 2 -> 4" in err and "config.json" in err
    # --reuse recomputes from the old rollouts anyway, says what differs, and records their settings.
    assert _run(**dict(other, n=2, max_tokens=8, reuse=True)) == 0
    assert "max_tokens: 4 -> 8" in capsys.readouterr().err
    assert json.loads((out / "eval_metrics.json").read_text())["sampling"]["max_tokens"] == 4
    assert _run(**dict(other, k="1,4", reuse=True)) == 2  # k=4 > the cached n=2
    err = capsys.readouterr().err
    assert "n=2 samples per problem" in err and "--n" not in err


@pytest.mark.subprocess
def test_eval_cli_with_tools(qwen_tiny_dir, data_root, tmp_path, capsys):
    """--tool-turns: the trainer's tool instruction on each prompt, the turn loop over the engine (a random
    model rarely closes a call: the mechanics, not the skill), the sets' tool metrics and the transcripts."""
    from pacs_megatron.envs.isolation import find_bwrap

    if find_bwrap() is None:  # --tool-sandbox auto is bubblewrap or a refusal (issue 57)
        pytest.skip("bubblewrap is not installed: apt-get install bubblewrap")
    out, tokenizer = tmp_path / "out", data_root / "tokenizers" / "qwen2.5"
    args = dict(model=qwen_tiny_dir, tokenizer=tokenizer, data="amc23", n=2, k="1", limit=2, reward_workers=0)
    assert _run(**args, max_tokens=6, tool_turns=2, out=out) == 0
    rows = [json.loads(line) for line in (out / "eval_rollout.jsonl").read_text().splitlines()]
    assert all("<tool_call>" in r["prompt"] and len(r["transcripts"]) == 2 for r in rows)
    metrics = json.loads((out / "eval_metrics.json").read_text())
    assert metrics["amc23"]["tools/turns_mean"] >= 1 and "tools/call_rate" in metrics["amc23"]
    assert metrics["sampling"]["tool_turns"] == 2 and metrics["sampling"]["tools"] == "python"
    sandbox = metrics["sampling"]["tool_sandbox"]  # issue 57: the level the calls ran at, and its limits
    assert sandbox["level"] == "bwrap" and sandbox["memory_mb_per_process"] > 0
    capsys.readouterr()
    assert _run(**args, tool_turns=2, tool_sandbox="rlimits", out=out) == 2  # renamed: said with eval's flag
    assert "--tool-sandbox rlimits is renamed --tool-sandbox rlimits-trusted" in capsys.readouterr().err
    assert _run(**args, tool_turns=1, out=out) == 2
    assert "--tool-turns 1" in capsys.readouterr().err
    assert _run(**args, tool_turns=2, tools="no tool", out=out) == 2
    assert "tools.enabled has 'no tool'" in capsys.readouterr().err
    # a tool that cannot load is named before the model is even looked at (here: a directory without one)
    assert _run(**dict(args, model=tmp_path), tool_turns=2, tools="no_such_pkg.mod:fn", out=out) == 2
    err = capsys.readouterr().err
    assert "no_such_pkg" in err and "config.json" not in err


def test_eval_cli_argument_errors(qwen_tiny_dir, data_root, tmp_path, capsys):
    assert _run(model=tmp_path, n=2, k="1,4") == 2
    assert "k=[4]" in capsys.readouterr().err
    assert _run(model=tmp_path, n=2, k="1", top_p=1.5) == 2
    assert "--top-p" in capsys.readouterr().err
    assert _run(model=tmp_path, n=2, k="1") == 2  # no config.json, no rollouts
    assert "config.json" in capsys.readouterr().err
    tokenizer = data_root / "tokenizers" / "qwen2.5"
    assert _run(model=qwen_tiny_dir, tokenizer=tokenizer, n=1, k="1", data="no_such_set", out=tmp_path) == 2
    assert "'no_such_set'" in capsys.readouterr().err
    nowhere = dict(model=qwen_tiny_dir, tokenizer=tokenizer, n=1, k="1", data="math500", out=tmp_path)
    nowhere["data_root"] = tmp_path / "nowhere"
    assert _run(**nowhere) == 2
    err = capsys.readouterr().err
    assert "--data-root" in err and "data.data_root" not in err


def test_a_mistyped_set_is_named_before_the_model_or_the_cache(tmp_path, capsys):
    """Fails on the old code: --data was checked only after the model loaded (here: the missing model was
    reported instead), behind a "sampling anew" line."""
    (tmp_path / "eval_rollout.jsonl").write_text("")
    assert _run(model=tmp_path / "no_model", n=1, k="1", data="math501", out=tmp_path) == 2
    err = capsys.readouterr().err
    assert "--data 'math501': neither a known name nor an existing file; did you mean math500?" in err
    assert "no_model" not in err and "sampling anew" not in err


def test_the_hf_engine_reports_progress_at_least_every_twentieth():
    """Issue 42: eval with the HF engine generated 64 problems x n a call, minutes between progress lines."""
    from pacs_megatron.tools.eval import progress_chunk

    assert progress_chunk("hf", 64, 500) == 25  # 20 calls, 20 lines
    assert progress_chunk("hf", 8, 500) == 8  # never above --batch-size
    assert progress_chunk("vllm", 64, 500) == 64 and progress_chunk("vllm", 64, 4000) == 200
    assert progress_chunk("hf", 64, 1) == 1
