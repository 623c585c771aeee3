"""Qwen3 (dense) in the Megatron actor, and the config / spec / layout rules of Qwen3 and Qwen3-MoE.

The distributed test runs TP=2 and then PP=2 in one 2-rank launch: HF import -> export bit-exact,
log-probs vs transformers in fp32 (<= 1e-5 relative per sequence), one train step at each layout.
"""

from __future__ import annotations

import pytest
import torch
from _actor_helpers import hf_config, hf_logprobs, make_qwen3, run_config, sample_batch, valid_positions
from _dist import run_distributed
from safetensors.torch import load_file

from pacs_megatron.batch.rows import as_train_batch
from pacs_megatron.config import ConfigError, ParallelConfig, TinyModelConfig
from pacs_megatron.data.synthetic import tiny_model_config
from pacs_megatron.hf.convert import export_order, hf_from_shards, hf_shapes, shard_from_hf
from pacs_megatron.hf.convert_moe import expert_hf_from_shard, expert_shard_from_hf
from pacs_megatron.hf.spec import model_spec_from_hf
from pacs_megatron.parallel.groups import check_layout

VOCAB = 255


def _moe_config(**kw):
    from transformers import Qwen3MoeConfig

    shape = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    shape.update(num_hidden_layers=4, intermediate_size=48, moe_intermediate_size=24, num_experts=4)
    return Qwen3MoeConfig(**{**shape, "num_experts_per_tok": 2, **kw})


def test_spec_qwen3_and_moe_layers():
    from transformers import Qwen3Config

    dense = model_spec_from_hf(Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=24, vocab_size=99), tp=2)
    assert dense.qk_norm and not dense.qkv_bias and dense.head_dim == 24 and not dense.is_moe
    assert dense.padded_vocab_size == 100
    moe = model_spec_from_hf(_moe_config(norm_topk_prob=True))
    assert moe.moe_layers == (0, 1, 2, 3) and moe.num_experts == 4 and moe.moe_ffn_hidden_size == 24
    # transformers' rule: sparse when not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0
    assert model_spec_from_hf(_moe_config(decoder_sparse_step=2, mlp_only_layers=[3])).moe_layers == (1,)
    assert not model_spec_from_hf(_moe_config()).norm_topk_prob
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        model_spec_from_hf(_moe_config(num_experts_per_tok=5))


def test_expert_parallel_validation():
    with pytest.raises(
        ConfigError, match=r"parallel.ep=2 must divide parallel.tp \* parallel.dp = 1\*1.*parallel.dp=2"
    ):
        ParallelConfig(tp=1, dp=1, ep=2)
    ParallelConfig(tp=2, dp=1, ep=2)  # EP drawn from the TP ranks (experts are not tensor-parallel)
    moe = _moe_config().to_dict()
    with pytest.raises(ConfigError, match="must divide the model's num_experts=4"):
        check_layout(ParallelConfig(tp=1, dp=3, ep=3), moe, 3)
    with pytest.raises(ConfigError, match="needs a MoE model"):
        check_layout(ParallelConfig(tp=1, dp=2, ep=2), {"model_type": "qwen3", "num_attention_heads": 4}, 2)
    check_layout(ParallelConfig(tp=1, dp=2, ep=2), {**moe, "num_local_experts": 4}, 2)  # transformers 5's spelling
    with pytest.raises(ConfigError, match="parallel.tp=2 with a MoE model needs parallel.sequence_parallel=true"):
        check_layout(ParallelConfig(tp=2, dp=1, ep=2), moe, 2)
    check_layout(ParallelConfig(tp=2, dp=1, ep=2), moe, 2, training=False)  # the parity tool's forward passes


def test_tiny_architectures():
    with pytest.raises(ConfigError, match="model.tiny.architecture"):
        TinyModelConfig(architecture="mixtral")
    with pytest.raises(ConfigError, match="num_experts_per_tok=3 exceeds"):
        TinyModelConfig(architecture="qwen3_moe", num_experts=2, num_experts_per_tok=3)
    from transformers import AutoConfig

    for arch in ("qwen2", "qwen3", "qwen3_moe"):
        d = tiny_model_config(TinyModelConfig(architecture=arch, intermediate_size=256), 20, 1, 0)
        spec = model_spec_from_hf(AutoConfig.for_model(**d))
        assert spec.model_type == arch and spec.qkv_bias == (arch == "qwen2")
    assert spec.moe_ffn_hidden_size == 128 and spec.num_experts == 4 and spec.norm_topk_prob


def test_expert_layouts_and_export_order():
    spec = model_spec_from_hf(_moe_config(mlp_only_layers=[1]))
    gate, up, down = torch.randn(24, 32), torch.randn(24, 32), torch.randn(32, 24)
    fc1 = shard_from_hf("expert_fc1", [gate, up], spec, tp_rank=1, tp_size=2)  # whole whatever the TP rank
    assert torch.equal(fc1, torch.cat([gate, up])) and torch.equal(expert_shard_from_hf("expert", [down]), down)
    assert [torch.equal(a, b) for a, b in zip(hf_from_shards("expert_fc1", [fc1, fc1], spec), [gate, up])] == [1, 1]
    assert torch.equal(expert_hf_from_shard("expert", down)[0], down)
    order = list(export_order(spec, lambda layer: layer // 2, ep_size=2))
    names = [n for names, _, _ in order for n in names]
    assert sorted(names) == sorted(hf_shapes(spec)), "export order and shapes disagree"
    assert "model.layers.1.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" not in names
    owners = {names[0]: (stage, ep) for names, stage, ep in order}
    assert owners["model.layers.2.mlp.experts.1.gate_proj.weight"] == (1, 0)
    assert owners["model.layers.2.mlp.experts.2.down_proj.weight"] == (1, 1)
    assert owners["model.layers.2.self_attn.q_norm.weight"] == (1, -1)


def _body(rank, world, model_dir):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    out = {}
    batch = sample_batch(VOCAB)
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        cfg = run_config(model_dir, tp=tp, pp=pp)
        actor = build_actor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir)), model_dir)
        w0 = {n: t.detach().cpu().clone() for n, t in actor.export_hf_weights()}
        lp = actor.compute_logprobs(batch, micro_batch_size=2, temperature=1.0)
        m = actor.train_step(as_train_batch(batch, lp.token_logp))
        out[name] = {"w0": w0, "token_logp": lp.token_logp, "seq_logp": lp.seq_logp, "m": m}
    return out


@pytest.mark.distributed
def test_qwen3_tp2_pp2_parity_and_round_trip(tmp_path):
    model_dir = make_qwen3(tmp_path / "q3", vocab=VOCAB)
    r = run_distributed(_body, 2, model_dir)[0]
    batch = sample_batch(VOCAB)
    valid = valid_positions(batch)
    hf = hf_logprobs(model_dir, batch.input_ids)
    hf_seq = (hf * batch.response_mask).sum(-1)
    orig = load_file(f"{model_dir}/model.safetensors")
    for name in ("tp2", "pp2"):
        x = r[name]
        assert set(x["w0"]) == set(orig) and all(torch.equal(x["w0"][k], orig[k]) for k in orig), name
        assert (x["token_logp"] - hf)[valid].abs().max() <= 1e-5, name
        assert ((x["seq_logp"] - hf_seq).abs() / hf_seq.abs()).max() <= 1e-5, name
        assert torch.isfinite(torch.tensor(list(x["m"].values()))).all(), name
