"""FP8 quantization at the weight sync (nvidia-modelopt, CPU): one tensor's round trip against modelopt's
own real quantization and an independent float8 cast, which tensors are quantized, what each engine
receives, and the config-time errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from pacs_megatron.config import ConfigError, SyncConfig, load_config
from pacs_megatron.config.rollout import RolloutConfig
from pacs_megatron.launch.checks.device import check_device
from pacs_megatron.rollout.base import EngineTraits
from pacs_megatron.rollout.vllm.reload import SyncStream
from pacs_megatron.weight_sync import WeightSync

pytest.importorskip("modelopt.torch.quantization")

from pacs_megatron.weight_sync.quantize import WeightQuantizer, vllm_fp8_config  # noqa: E402

E4M3_MAX = 448.0


def _weight(rows=256, cols=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 0.02


def test_fp8_per_tensor_round_trip_matches_modelopt_and_a_float8_cast():
    w = _weight()
    wq = WeightQuantizer("fp8", "auto")
    assert wq.recipe == "FP8_DEFAULT_CFG"
    fake = wq.fake_quantize(w)
    # modelopt's own reference: its real FP8 quantization (FP8QTensor), dequantized.
    data, scale = wq.real_quantize(w)
    assert data.dtype == torch.float8_e4m3fn and scale.numel() == 1
    torch.testing.assert_close(fake, data.float() * scale, rtol=0, atol=1e-7)
    # An independent computation: one scale amax / 448, torch's float8 cast (round to nearest even).
    s = w.abs().max() / E4M3_MAX
    torch.testing.assert_close(fake, (w / s).to(torch.float8_e4m3fn).float() * s, rtol=1e-6, atol=1e-8)
    err = (fake - w).abs()
    assert 0 < err.max() <= w.abs().max() / 16  # E4M3: 3 mantissa bits, relative step <= 2^-3 (half: rounding)
    assert fake.shape == w.shape and fake.dtype == w.dtype


def test_fp8_block_recipe_has_one_scale_per_128x128_block():
    w = _weight(256, 384)
    wq = WeightQuantizer("fp8", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG")
    data, scale = wq.real_quantize(w)
    assert tuple(scale.shape) == (2, 3)
    fake = wq.fake_quantize(w)
    deq = data.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    torch.testing.assert_close(fake, deq, rtol=0, atol=1e-7)
    block = w[:128, 128:256]
    s = block.abs().max() / E4M3_MAX
    torch.testing.assert_close(fake[:128, 128:256], (block / s).to(torch.float8_e4m3fn).float() * s)
    assert wq.vllm_quantization_config()["weight_block_size"] == [128, 128]


def test_only_linear_matrices_are_selected():
    wq = WeightQuantizer("fp8", "auto", RolloutConfig().quant_exclude)
    m = torch.zeros(4, 4)
    assert wq.selects("model.layers.0.self_attn.q_proj.weight", m)
    assert wq.selects("model.layers.1.mlp.down_proj.weight", m)
    assert not wq.selects("model.embed_tokens.weight", m)
    assert not wq.selects("lm_head.weight", m)
    assert not wq.selects("model.layers.0.input_layernorm.weight", torch.zeros(4))
    assert not wq.selects("model.layers.0.self_attn.q_proj.bias", torch.zeros(4))
    assert WeightQuantizer("fp8", "auto", ()).selects("lm_head.weight", m)  # "unless configured"


class _Actor:
    def __init__(self):
        self.tensors = [
            ("model.embed_tokens.weight", _weight(64, 32, 1)),
            ("model.layers.0.mlp.down_proj.weight", _weight(32, 64, 2)),
            ("model.norm.weight", torch.ones(32)),
        ]

    def export_hf_weights(self):
        yield from self.tensors


class _Engine:
    def __init__(self, fp8: bool, in_place: bool):
        self.fp8, self.in_place, self.got = fp8, in_place, {}

    def traits(self) -> EngineTraits:
        return EngineTraits(loads_in_place=self.in_place, fp8_weights=self.fp8)

    def update_weights(self, buckets):
        self.got = {n: t for b in buckets for n, t in b}
        return len(self.got)

    def logprobs(self, token_ids, temperature=1.0):
        raise AssertionError("sync.probe_sequences=0: nothing is probed")


def _sync(engine, dtype="auto"):
    rollout = RolloutConfig(quantization="fp8")
    return WeightSync(_Actor(), engine, SyncConfig(probe_sequences=0, dtype=dtype), 64, torch.float32, rollout)


def test_hf_engine_gets_the_dequantized_stream_vllm_gets_fp8_and_scales():
    actor = _Actor()
    wq = WeightQuantizer("fp8", "auto")
    hf = _Engine(fp8=False, in_place=True)
    _sync(hf).push()
    name = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(hf.got[name], wq.fake_quantize(actor.tensors[1][1]), rtol=0, atol=0)
    assert not torch.equal(hf.got[name], actor.tensors[1][1])
    assert torch.equal(hf.got["model.embed_tokens.weight"], actor.tensors[0][1])  # kept in the actor's dtype
    vllm = _Engine(fp8=True, in_place=False)
    _sync(vllm, dtype="bfloat16").push()
    assert vllm.got[name].dtype == torch.float8_e4m3fn  # never cast by the bf16 transport
    assert vllm.got[name + "_scale"].dtype == torch.float32 and vllm.got[name + "_scale"].dim() == 0
    assert vllm.got["model.norm.weight"].dtype == torch.float32


def test_vllm_sync_stream_accepts_scales_of_known_weights_only():
    stream = SyncStream((frozenset({"a.weight"}), frozenset()), ("_scale", "_scale_inv"))
    sent = [("a.weight", torch.zeros(1)), ("a.weight_scale", torch.ones(()))]
    assert [n for n, _ in stream.tensors([sent])] == ["a.weight", "a.weight_scale"]
    assert stream.finish() == 2  # the weight and its scale
    with pytest.raises(KeyError, match="b.weight_scale"):
        list(
            SyncStream((frozenset({"a.weight"}), frozenset()), ("_scale",)).tensors(
                [[("b.weight_scale", torch.ones(()))]]
            )
        )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["rollout.quantization=nvfp4", "parallel.backend=gloo"], "rollout.quantization=nvfp4 needs CUDA"),
        (["rollout.quantization=fp8", "rollout.quant_recipe=FP8_NOPE"], "rollout.quant_recipe='FP8_NOPE'"),
        (["rollout.quantization=fp8", "rollout.quant_recipe=NVFP4_DEFAULT_CFG"], "not rollout.quantization='fp8'"),
        (["rollout.quantization=int4"], "rollout.quantization='int4' is not valid"),
        (
            ["rollout.quantization=fp8", "rollout.engine=vllm", "rollout.quant_recipe=FP8_PER_CHANNEL_PER_TOKEN_CFG"],
            "per-tensor or 2-D block",
        ),
    ],
)
def test_bad_quantization_config_is_one_clear_error(overrides, match, vllm_installed):
    with pytest.raises(ConfigError, match=match):
        check_device(load_config(None, overrides))


def test_fp8_without_modelopt_names_the_option_and_the_fix(monkeypatch):
    import pacs_megatron.weight_sync.quantize as quantize

    monkeypatch.setattr(quantize, "modelopt_available", lambda: False)
    with pytest.raises(ConfigError, match="rollout.quantization=fp8 needs nvidia-modelopt.*pip install"):
        check_device(load_config(None, ["rollout.quantization=fp8"]))
    check_device(load_config(None, ["rollout.quantization=none"]))  # the default never asks for modelopt


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL not installed: nothing sets it")
def test_importing_modelopt_leaves_vllm_logging_as_it_was():
    """modelopt.torch imports TRL where installed, and TRL's import set VLLM_LOGGING_LEVEL=ERROR: a quantized
    run's vLLM engines (this process's and its children's) went silent. A fresh process, as the first import."""
    script = (
        "import os, sys\n"
        "from pacs_megatron.weight_sync.quantize import weight_quantizer_cfg\n"
        "weight_quantizer_cfg('FP8_DEFAULT_CFG')\n"
        "assert 'trl' in sys.modules, 'modelopt no longer imports TRL: nothing to check'\n"
        "print(os.environ.get('VLLM_LOGGING_LEVEL'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "None"
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**env, "VLLM_LOGGING_LEVEL": "DEBUG"}
    )
    assert run.stdout.split()[-1] == "DEBUG"  # a level the user set is theirs


def _quantized_sync_body(rank, world, model_dir):
    from transformers import AutoTokenizer

    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel
    from pacs_megatron.rollout.hf_engine import HFEngine

    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "model.init=random",
            "model.dtype=float32",
            "parallel.tp=2",
            "rollout.quantization=fp8",
            "rollout.quant_exclude=[]",  # the LM head and embeddings too: every layout kind is swapped
            "sync.probe_sequences=3",
        ],
    )
    hf_cfg = json.loads((model_dir / "config.json").read_text())
    groups = initialize_parallel(cfg.parallel, hf_cfg)
    actor = build_actor(cfg, groups, str(model_dir))
    engine = HFEngine(model_dir, AutoTokenizer.from_pretrained(str(model_dir)), device="cpu", dtype=torch.float32)
    before = {n: t.clone() for n, t in actor.export_hf_weights()}
    res = WeightSync(actor, engine, cfg.sync, hf_cfg["vocab_size"], actor.param_dtype, cfg.rollout).sync()
    after = dict(actor.export_hf_weights())
    wq = WeightQuantizer("fp8", "auto", ())
    engine_params = dict(engine.model.named_parameters())
    return {
        "probe": res.max_logprob_diff,
        "gap": res.quant_logprob_diff,
        "restored": all(torch.equal(before[n], after[n]) for n in before),
        "engine_is_fp8": all(
            torch.equal(engine_params[n], wq.fake_quantize(t)) for n, t in before.items() if wq.selects(n, t)
        ),
        "quantized": sum(wq.selects(n, t) for n, t in before.items()),
    }


@pytest.mark.distributed
def test_tp2_quantized_sync_probes_and_restores_the_actor(tmp_path):
    from _dist import run_distributed

    from pacs_megatron.config import TinyModelConfig
    from pacs_megatron.data.synthetic import write_tiny_model_dir

    shape = dict(hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    model_dir = write_tiny_model_dir(tmp_path / "m", TinyModelConfig(**shape, tie_word_embeddings=False))
    for rank, r in enumerate(run_distributed(_quantized_sync_body, 2, model_dir)):
        where = f"rank {rank}: {r}"
        assert r["probe"] < 1e-5 and r["gap"] > 1e-4, where  # exact transfer of a real FP8 policy gap
        assert r["restored"] and r["engine_is_fp8"], where  # the actor trains on its own weights again
        assert r["quantized"] == 2 * 7 + 2, where  # q k v o gate up down per layer, embeddings, LM head


@pytest.mark.gpu
def test_nvfp4_fake_quant_on_cuda():
    """Never run (no GPU in the session that wrote it): modelopt's NVFP4 quantize-dequantize on CUDA."""
    check_device(load_config(None, ["rollout.quantization=nvfp4", "parallel.backend=nccl"]))  # accepted with CUDA
    w = _weight(128, 256).cuda()
    fake = WeightQuantizer("nvfp4", "auto").fake_quantize(w)
    assert fake.shape == w.shape and not torch.equal(fake, w)
    assert (fake - w).abs().max() <= w.abs().max() / 2  # E2M1: 1 mantissa bit, per-16 block scales


def test_the_sync_hands_vllm_the_fp8_layout_it_sends():
    """The engine is built with the sender's description of its FP8 weights (it never reads the recipe)."""
    from pacs_megatron.loop.build import engine_run
    from pacs_megatron.rollout.vllm.params import llm_kwargs

    fp8 = ["model.path=/m", "rollout.engine=vllm", "rollout.quantization=fp8"]
    cfg = load_config(None, [*fp8, "rollout.quant_recipe=FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"])
    layout = vllm_fp8_config(cfg.rollout)
    assert layout == {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert vllm_fp8_config(load_config(None, fp8).rollout) == {"quant_method": "fp8", "activation_scheme": "dynamic"}
    kw = llm_kwargs(cfg.rollout, engine_run(cfg), "/m", True, fp8_config=layout)
    assert (kw["quantization"], kw["hf_overrides"], kw["load_format"]) == (
        "fp8",
        {"quantization_config": layout},
        "dummy",
    )
    for other in (["rollout.engine=hf", "rollout.quantization=fp8"], ["rollout.engine=vllm"]):
        assert vllm_fp8_config(load_config(None, ["model.path=/m", *other]).rollout) is None
