"""Defect 7: both engines stop on one set (tokenizer EOS + generation_config.json EOS, or
rollout.stop_token_ids). The HF engine is run; the vLLM engine's request parameters are built (CPU)."""

from __future__ import annotations

import json
import shutil

import pytest
from _forcing import force_next_token

from pacs_megatron.config import TinyModelConfig, load_config
from pacs_megatron.data.synthetic import write_tiny_model_dir
from pacs_megatron.loop.build import build_rollout_engine
from pacs_megatron.rollout.stop_tokens import resolve_stop_token_ids
from pacs_megatron.rollout.types import SamplingParams
from pacs_megatron.rollout.vllm.engine import sampling_kwargs

TINY = TinyModelConfig(
    hidden_size=32,
    num_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    tie_word_embeddings=False,
)
EXTRA_EOS = 7  # a second EOS id, as Qwen2.5-Instruct's <|endoftext|> next to <|im_end|>


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stop")
    plain = write_tiny_model_dir(root / "plain", TINY)
    with_gc = root / "with_gc"
    shutil.copytree(plain, with_gc)
    (with_gc / "generation_config.json").write_text(json.dumps({"eos_token_id": [EXTRA_EOS]}))
    return plain, with_gc


def _forced(engine, token_id: int):
    """Every next token is ``token_id``."""
    return force_next_token(engine, token_id, head_weight=30.0)


def _engine(model_dir, *overrides):
    from transformers import AutoTokenizer

    cfg = load_config(None, [f"model.path={model_dir}", *overrides])
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return build_rollout_engine(cfg, model_dir, tok, "cpu"), tok, cfg


def test_hf_engine_stops_on_generation_config_eos_like_vllm(dirs):
    plain, with_gc = dirs
    sampling = SamplingParams(n=2, max_tokens=5, seed=0)
    eng, tok, cfg = _engine(with_gc)
    assert eng.stop_token_ids == tuple(sorted({tok.eos_token_id, EXTRA_EOS}))
    out = _forced(eng, EXTRA_EOS).generate([[1, 2, 3]], sampling)
    assert all(r.token_ids == (EXTRA_EOS,) and r.finish_reason == "stop" for r in out[0])
    # the vLLM engine's requests carry the same set, and ignore_eos keeps vLLM from adding its own
    kw = sampling_kwargs(sampling, resolve_stop_token_ids(tok, with_gc, cfg.rollout.stop_token_ids), seed=1)
    assert kw["stop_token_ids"] == list(eng.stop_token_ids) and kw["ignore_eos"] is True
    # without generation_config.json the same token does not stop generation
    eng2, _, _ = _engine(plain)
    out2 = _forced(eng2, EXTRA_EOS).generate([[1, 2, 3]], sampling)
    assert all(len(r.token_ids) == 5 and r.finish_reason == "length" for r in out2[0])


def test_configured_stop_set_replaces_the_default(dirs):
    _, with_gc = dirs
    eng, tok, cfg = _engine(with_gc, "rollout.stop_token_ids=[11]")
    assert eng.stop_token_ids == (11,)
    out = _forced(eng, EXTRA_EOS).generate([[1, 2]], SamplingParams(n=1, max_tokens=3, seed=0))
    assert out[0][0].finish_reason == "length"  # 7 is no longer a stop token
    kw = sampling_kwargs(SamplingParams(n=1), resolve_stop_token_ids(tok, with_gc, cfg.rollout.stop_token_ids), 0)
    assert kw["stop_token_ids"] == [11]
