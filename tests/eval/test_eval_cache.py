"""The eval cache key and its differences, and progress reporting during generation."""

import argparse
import logging

import pytest

from pacs_megatron.config import ArithTaskConfig, RewardConfig
from pacs_megatron.data.synthetic import arith_problems, arith_records, build_arith_tokenizer
from pacs_megatron.eval.cache import cache_key, differences, model_fingerprint
from pacs_megatron.eval.progress import EvalProgress
from pacs_megatron.eval.runner import evaluate
from pacs_megatron.reward import RewardScorer
from pacs_megatron.rollout.types import Response, SamplingParams
from pacs_megatron.tools import eval as cli


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_key_changes_with_every_sampling_setting_and_the_weights(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = dict(model=model, data="a.jsonl,b.jsonl")
    key = cache_key(_args(**base), model, tmp_path)
    assert differences(key, cache_key(_args(**base), model, tmp_path)) == []
    for flag, value, field in [
        ("n", 4, "n"),
        ("temperature", 0.9, "temperature"),
        ("top_p", 0.5, "top_p"),
        ("max_tokens", 64, "max_tokens"),
        ("seed", 7, "seed"),
        ("data", "a.jsonl", "data"),
    ]:
        changed = differences(key, cache_key(_args(**{**base, flag: value}), model, tmp_path))
        assert changed and changed[0].startswith(f"{field}:"), (flag, changed)
        assert all(c.startswith(field) for c in changed), changed  # data also changes data_files
    before = model_fingerprint(model)
    (model / "model.safetensors").write_bytes(b"x" * 10)  # new weights in the same directory
    assert model_fingerprint(model) != before
    assert differences(None, key) == ["no sampling settings recorded with these rollouts"]


class _Engine:
    def __init__(self, tok):
        self.tok, self.seeds = tok, []

    def generate(self, prompt_token_ids, sampling):
        self.seeds.append(sampling.seed)
        return [[Response((5,), "1", "stop")] * sampling.n for _ in prompt_token_ids]


@pytest.mark.subprocess
def test_progress_chunks_generation_and_logs_plain_lines(caplog):
    tok = build_arith_tokenizer()
    recs = arith_records(arith_problems(ArithTaskConfig(max_operand=2, modulo=0)), tok)  # 9 problems
    engine = _Engine(tok)
    logging.getLogger("pacs_megatron").propagate = True  # caplog listens at the root; conftest restores it
    with caplog.at_level(logging.INFO, logger="pacs_megatron"):
        with RewardScorer(RewardConfig(fn="arith", num_workers=0)) as scorer:
            with EvalProgress(len(recs), chunk=4, tty=False) as progress:
                metrics, rows = evaluate(
                    engine,
                    {"arith": recs},
                    SamplingParams(n=2, max_tokens=1, seed=10),
                    [1],
                    scorer,
                    progress=progress,
                )
    assert engine.seeds == [10, 11, 12]  # chunks of 4, 4, 1 prompts, each with its own seed
    assert len(rows) == 9 and progress.done == 9
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sampled")]
    assert lines[-1].startswith("sampled 9/9 problems (100%)") and "ETA" in lines[0]
