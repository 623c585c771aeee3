"""The reload sync into a real vLLM engine on CPU, on an UNTIED tiny Qwen2 (the tied case, with vLLM's stale
LM-head repack, is tests/rollout/test_vllm_cpu.py): float32 round trips through vLLM's layerwise reload,
bf16 sending, and a sync that misses a whole layer's tensors raises while vLLM itself only warns."""

from __future__ import annotations

import pytest
import torch
from _vllm import cpu_engine, moved_state, needs_vllm, saved_model, worst

from pacs_megatron.weight_sync import iter_buckets

pytestmark = needs_vllm
SEQS = [[1, 5, 7, 9, 3, 4, 6, 12, 2], [6, 13, 8, 14, 5, 5, 10, 11, 9, 3, 4, 1]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    with cpu_engine(saved_model(tmp_path_factory.mktemp("vllm") / "untied", tied=False, seed=1)) as pair:
        yield pair


def test_reload_round_trips_on_an_untied_model(engines):
    engine, ref = engines
    assert worst(engine.logprobs(SEQS), ref.logprobs(SEQS)) <= 1e-5
    for _ in range(2):
        state = moved_state(ref)
        assert engine.update_weights(iter_buckets(iter(state), 1 << 14)) == len(state)
        assert worst(engine.logprobs(SEQS), ref.logprobs(SEQS)) <= 1e-5
    state = moved_state(ref, scale=0.02)  # bf16 on the wire: vLLM casts into its float32 parameters
    engine.update_weights(iter_buckets(iter(state), 1 << 14, torch.bfloat16))
    assert 1e-6 < worst(engine.logprobs(SEQS), ref.logprobs(SEQS)) < 5e-2


def test_a_sync_missing_a_layer_raises(engines):
    engine, ref = engines
    state = moved_state(ref)
    lost = [(n, t) for n, t in state if not n.startswith("model.layers.0.self_attn.")]
    with pytest.raises(RuntimeError, match="7 HF tensors never arrived"):  # q/k/v weights and biases + o_proj
        engine.update_weights([lost])
    assert worst(engine.logprobs(SEQS), ref.logprobs(SEQS)) > 1e-3  # the layer kept its old weights
