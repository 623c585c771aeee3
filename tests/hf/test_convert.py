"""HF <-> Megatron layouts (pure tensor functions), HF file I/O, architecture checks, Llama 3, random init."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from _dist import run_distributed
from transformers import LlamaConfig, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "actor"))
from _actor_helpers import hf_config, hf_logprobs, run_config, sample_batch, valid_positions

from pacs_megatron.actor.model import llama3_inv_freq, mask_padded_vocab
from pacs_megatron.batch.rows import as_train_batch
from pacs_megatron.config import ConfigError
from pacs_megatron.hf.convert import hf_from_shards, hf_shapes, shard_from_hf
from pacs_megatron.hf.io import SafetensorsReader, write_safetensors
from pacs_megatron.hf.spec import model_spec_from_hf

H, HEADS, KV, HD, FFN, VOCAB = 16, 8, 4, 2, 12, 10


def _spec(tp: int):
    return model_spec_from_hf(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=H,
            num_attention_heads=HEADS,
            num_key_value_heads=KV,
            intermediate_size=FFN,
            num_hidden_layers=2,
        ),
        tp,
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_kind_round_trips_bit_exactly(tp):
    spec = _spec(tp)
    g = torch.Generator().manual_seed(0)
    cases = {
        "qkv_w": [
            torch.randn(HEADS * HD, H, generator=g),
            torch.randn(KV * HD, H, generator=g),
            torch.randn(KV * HD, H, generator=g),
        ],
        "qkv_b": [
            torch.randn(HEADS * HD, generator=g),
            torch.randn(KV * HD, generator=g),
            torch.randn(KV * HD, generator=g),
        ],
        "fc1": [torch.randn(FFN, H, generator=g), torch.randn(FFN, H, generator=g)],
        "row": [torch.randn(H, HEADS * HD, generator=g)],
        "vocab": [torch.randn(VOCAB, H, generator=g)],
        "rep": [torch.randn(H, generator=g)],
    }
    for kind, hf in cases.items():
        shards = [shard_from_hf(kind, hf, spec, r, tp) for r in range(tp)]
        assert len({tuple(s.shape) for s in shards}) == 1, f"{kind}: uneven shards"
        back = hf_from_shards(kind, shards, spec)
        assert all(torch.equal(a, b) for a, b in zip(back, hf)), kind


def test_qkv_grouped_layout_matches_megatron_order():
    """Rows of the fused QKV, written out head by head: group g = [q heads of g | k_g | v_g]."""
    spec = _spec(tp=2)
    rep = HEADS // KV
    q = torch.arange(HEADS * HD, dtype=torch.float32)[:, None].repeat(1, H)
    k = 1000 + torch.arange(KV * HD, dtype=torch.float32)[:, None].repeat(1, H)
    v = 2000 + torch.arange(KV * HD, dtype=torch.float32)[:, None].repeat(1, H)
    expected = []
    for grp in range(KV):
        for head in range(grp * rep, (grp + 1) * rep):
            expected.append(q[head * HD : (head + 1) * HD])
        expected += [k[grp * HD : (grp + 1) * HD], v[grp * HD : (grp + 1) * HD]]
    full = torch.cat(expected)
    half = full.shape[0] // 2
    assert torch.equal(shard_from_hf("qkv_w", [q, k, v], spec, 0, 2), full[:half])
    assert torch.equal(shard_from_hf("qkv_w", [q, k, v], spec, 1, 2), full[half:])


def test_fc1_and_vocab_shards():
    spec = _spec(tp=4)
    gate, up = torch.randn(FFN, H), torch.randn(FFN, H)
    r = 1
    assert torch.equal(shard_from_hf("fc1", [gate, up], spec, r, 4), torch.cat([gate[3:6], up[3:6]]))
    emb = torch.randn(VOCAB, H)
    assert spec.padded_vocab_size == 12
    last = shard_from_hf("vocab", [emb], spec, 3, 4)
    assert torch.equal(last[:1], emb[9:10]) and torch.equal(last[1:], torch.zeros(2, H))
    shapes = hf_shapes(spec)
    assert shapes["model.layers.1.self_attn.k_proj.bias"] == (KV * HD,) and "lm_head.weight" in shapes


def test_padded_vocab_is_masked_on_the_last_rank():
    spec = _spec(tp=4)  # 10 real ids in 12: the last rank (ids 9..11) holds 2 padding columns
    logits = torch.zeros(1, 1, 3)
    last = mask_padded_vocab(logits, spec, types.SimpleNamespace(tp_rank=3))
    assert last[0, 0, 0] == 0 and (last[0, 0, 1:] < -1e29).all()
    assert mask_padded_vocab(logits, spec, types.SimpleNamespace(tp_rank=0)) is logits


def test_unsupported_models_are_rejected():
    with pytest.raises(ConfigError, match="supports"):
        model_spec_from_hf(types.SimpleNamespace(model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ConfigError, match="rope type 'yarn'"):
        model_spec_from_hf(LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ConfigError, match="silu"):
        model_spec_from_hf(Qwen2Config(hidden_act="gelu"))


def test_llama3_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _llama_config()
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert torch.allclose(llama3_inv_freq(model_spec_from_hf(hf)), ref, rtol=1e-6, atol=0)


def test_safetensors_sharded_write_and_read(tmp_path):
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}
    names = write_safetensors(tensors.items(), tmp_path, max_shard_bytes=900)
    assert len(names) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    reader = SafetensorsReader(tmp_path)
    assert sorted(reader.names()) == sorted(tensors)
    assert all(torch.equal(reader.get(k), v) for k, v in tensors.items())
    with pytest.raises(KeyError, match="no tensor 'missing'"):
        reader.get("missing")
    with pytest.raises(FileNotFoundError, match="model.init=random"):
        SafetensorsReader(tmp_path / "empty")


# --------------------------------------------------------------------------- one process: Llama, init


def _llama_config():
    return LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )


def _one_process_body(rank, world, llama_dir, qwen_dir):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    groups = initialize_parallel(run_config(llama_dir).parallel, hf_config(llama_dir))
    llama = build_actor(run_config(llama_dir), groups, llama_dir)
    batch = sample_batch(96)
    lp = llama.compute_logprobs(batch, 2, 1.0).token_logp
    out = {"llama_logp": lp}
    # supervised warm-up loss through the registry: token-mean NLL of the response tokens
    out["sft"] = llama.train_step(as_train_batch(batch, torch.zeros_like(lp)), loss_name="sft")
    before = {n: t.clone() for n, t in llama.export_hf_weights()}
    # a NaN loss gives a NaN gradient norm: the step is skipped and counted, weights untouched
    out["nan"] = llama.train_step(as_train_batch(batch, torch.full_like(lp, float("nan"))))
    out["nan_unchanged"] = all(torch.equal(before[n], t) for n, t in llama.export_hf_weights())
    exports = {}
    for key, seed in (("a", 7), ("b", 7), ("c", 8)):
        actor = build_actor(run_config(qwen_dir, init="random", seed=seed), groups, qwen_dir)
        exports[key] = {n: t.clone() for n, t in actor.export_hf_weights()}
    out["random"] = exports
    return out


@pytest.mark.distributed
def test_llama3_and_random_init(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    llama_dir = str(tmp_path / "llama")
    LlamaForCausalLM(_llama_config()).save_pretrained(llama_dir)
    qwen_dir = tmp_path / "qwen_config_only"
    qwen_dir.mkdir()
    Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(qwen_dir)
    r = run_distributed(_one_process_body, 1, llama_dir, str(qwen_dir))[0]
    batch = sample_batch(96)
    # positions reach 12 > original_max 16 / 4: the scaled frequencies matter
    diff = (r["llama_logp"] - hf_logprobs(llama_dir, batch.input_ids))[valid_positions(batch)]
    assert diff.abs().max() <= 1e-5
    mask = batch.response_mask
    nll = -(r["llama_logp"] * mask).sum() / mask.sum()
    assert r["sft"]["sft/loss"] == pytest.approx(float(nll), rel=1e-6)
    assert r["sft"]["actor/skipped_steps"] == 0.0 and r["sft"]["actor/max_abs_logratio"] > 0  # old_logp = 0
    assert r["nan"]["actor/skipped_steps"] == 1.0 and r["nan_unchanged"]
    a, b, c = (r["random"][k] for k in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a), "random init is not deterministic for a seed"
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    assert Path(qwen_dir / "config.json").is_file() and not list(qwen_dir.glob("*.safetensors"))
