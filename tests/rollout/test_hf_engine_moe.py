"""The HF engine on a tiny Qwen3-MoE: weight sync of per-expert tensors into transformers 5's fused
expert parameters, and routing recording (the experts every token was sent to)."""

from __future__ import annotations

import pytest
import torch

from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.config import TinyModelConfig
from pacs_megatron.data.routing import RoutedExperts
from pacs_megatron.data.synthetic import build_arith_tokenizer, write_tiny_model_dir
from pacs_megatron.rollout.hf_engine import HFEngine, fused_expert_slice
from pacs_megatron.rollout.types import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tiny = TinyModelConfig(architecture="qwen3_moe", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    return write_tiny_model_dir(tmp_path_factory.mktemp("moe") / "m", tiny)


def _per_expert_tensors(engine: HFEngine) -> dict[str, torch.Tensor]:
    """The engine's weights under checkpoint names (one tensor per expert), as the actor exports them."""
    out = {}
    for name, p in engine.model.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], p.shape[1] // 2
            for g in range(p.shape[0]):
                out[f"{prefix}{g}.gate_proj.weight"] = p[g, :half].clone()
                out[f"{prefix}{g}.up_proj.weight"] = p[g, half:].clone()
        elif name.endswith("experts.down_proj"):
            for g in range(p.shape[0]):
                out[f"{name[: -len('down_proj')]}{g}.down_proj.weight"] = p[g].clone()
        else:
            out[name] = p.detach().clone()
    return out


def test_expert_sync_and_routing_record(model_dir):
    tok = build_arith_tokenizer()
    torch.manual_seed(1)
    source = HFEngine(model_dir, tok, record_routing=True, seed=5)
    torch.manual_seed(2)
    target = HFEngine(model_dir, tok, record_routing=True, seed=5)
    weights = _per_expert_tensors(source)
    assert any(".mlp.experts.3.down_proj.weight" in n for n in weights)
    assert fused_expert_slice(target._params, "model.layers.0.mlp.experts.9.up_proj.weight") is None  # 4 experts
    with pytest.raises(RuntimeError, match="unwritten"):  # one expert missing: a partial sync
        target.update_weights([[(n, t) for n, t in weights.items() if ".experts.2.gate_proj" not in n]])
    assert target.update_weights([list(weights.items())]) == len(target._params)
    assert all(torch.equal(a, b) for a, b in zip(source.model.parameters(), target.model.parameters()))

    prompts = [[3, 4, 5], [6, 7]]
    groups = target.generate(prompts, SamplingParams(n=2, max_tokens=4))
    flat = [(p, r) for p, g in zip(prompts, groups) for r in g]
    layers, k = 2, 2
    for p, r in flat:
        assert r.routed_experts.shape == (len(p) + len(r.token_ids), layers, k)
        assert (r.routed_experts.sort(-1).values.diff(dim=-1) > 0).all(), "k distinct experts per token"
    # recorded experts are the ones a plain forward of the whole sequence picks (prompt and response;
    # the last response token is never fed: it holds 0..k-1)
    seq = flat[0][0] + list(flat[0][1].token_ids)
    target.routing._last = [None] * layers
    target.model(input_ids=torch.tensor([seq]))
    full = target.routing.take((1, len(seq)))[0]
    assert torch.equal(full[:-1], flat[0][1].routed_experts[:-1])
    batch = build_rollouts([p for p, _ in flat], [r.token_ids for _, r in flat], [0.0] * 4, 2, pad_id=0)
    routed = RoutedExperts.from_records([r.routed_experts for _, r in flat], batch.seq_lens).padded(
        batch.input_ids.shape[1]
    )
    assert routed.shape == (*batch.input_ids.shape, layers, k) and routed.dtype == torch.uint8
    short = int(batch.seq_lens.argmin())
    assert routed[short, -1].tolist() == [[0, 1]] * layers or int(batch.seq_lens[short]) == routed.shape[1]
    with pytest.raises(ValueError, match="row 0: routed experts for"):
        RoutedExperts.from_records([r.routed_experts[:-1] for _, r in flat], batch.seq_lens)


def test_routing_record_has_every_decoder_layer_when_some_are_dense(tmp_path):
    """The actor replays by global layer number (actor/moe/routing.py): with a dense layer first
    (``mlp_only_layers=[0]``) the record must keep layer 1's experts at index 1, not at 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = TinyModelConfig(architecture="qwen3_moe", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    path = write_tiny_model_dir(tmp_path / "m", tiny)
    config = AutoConfig.from_pretrained(path)
    config.mlp_only_layers = [0]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    engine = HFEngine(path, build_arith_tokenizer(), record_routing=True, seed=5)
    prompt = [3, 4, 5]
    ((resp,),) = engine.generate([prompt], SamplingParams(n=1, max_tokens=3))
    record = resp.routed_experts
    assert record.shape == (len(prompt) + len(resp.token_ids), 2, 2)
    assert record[:, 0].tolist() == [[0, 1]] * record.shape[0]  # the dense layer holds the filler
    seq = prompt + list(resp.token_ids)
    engine.model(input_ids=torch.tensor([seq]))
    router = engine.routing.routers[0]
    assert engine.routing.layers == [1]
    assert torch.equal(engine.routing._last[0].reshape(len(seq), 2)[:-1].to(torch.int16), record[:-1, 1])
    assert router is engine.model.model.layers[1].mlp.gate
