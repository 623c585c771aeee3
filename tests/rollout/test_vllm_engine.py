"""vLLM engine, pure translation (no vllm needed): config -> ``LLM`` kwargs on CPU and GPU, seeds, replica
layout, vLLM outputs -> :class:`Response`, the sync stream's name checks, the vLLM preflight check.

The output records follow vLLM 0.32's shapes: ``RequestOutput.outputs`` (``CompletionOutput`` with
``index``, ``token_ids``, ``finish_reason``, ``logprobs`` = one ``{token: Logprob}`` dict per generated
token) and ``RequestOutput.prompt_logprobs`` (None at position 0). The real engine runs on CPU in
tests/rollout/test_vllm_cpu.py and tests/rollout/test_vllm_reload.py; GPU (never run):
``pytest -m gpu tests/rollout/test_vllm_engine.py`` on a machine with vllm 0.32.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pacs_megatron.config import ConfigError, TinyModelConfig, load_config
from pacs_megatron.data.synthetic import write_tiny_model_dir
from pacs_megatron.launch.checks.preflight import check_vllm_context
from pacs_megatron.loop.build import engine_args, engine_run
from pacs_megatron.rollout.types import SamplingParams
from pacs_megatron.rollout.vllm.engine import VLLMEngine
from pacs_megatron.rollout.vllm.params import (
    colocated_memory_utilization,
    llm_kwargs,
    prompt_logprob_kwargs,
    prompt_logprobs_tensor,
    request_seed,
    sampling_kwargs,
    to_responses,
    vllm_replica,
)
from pacs_megatron.rollout.vllm.reload import SyncStream, expected_hf_names
from pacs_megatron.utils.dist import free_port
from pacs_megatron.weight_sync import iter_buckets

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("vllm") / "tied", TINY)


def cfg_for(model_dir, *overrides):
    return load_config(None, [f"model.path={model_dir}", "rollout.engine=vllm", *overrides])


# ------------------------------------------------------------------------------ layout and config translation


@pytest.mark.parametrize(
    ("rank", "world", "tp", "expected"),
    [(0, 1, 1, (0, 1)), (3, 4, 1, (3, 4)), (3, 4, 2, (1, 2)), (5, 8, 4, (1, 2)), (7, 8, 8, (0, 1)), (6, 8, 2, (3, 4))],
)
def test_vllm_replica(rank, world, tp, expected):
    assert vllm_replica(rank, world, tp) == expected


def test_vllm_replica_rejects_bad_layouts():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the job's 4 ranks"):
        vllm_replica(0, 4, 3)
    with pytest.raises(ValueError, match="outside"):
        vllm_replica(4, 4, 2)


def test_llm_kwargs_translate_the_run_config(model_dir, tmp_path):
    cfg = cfg_for(
        model_dir,
        "model.dtype=float32",
        "rollout.seed=11",
        "rollout.max_response_length=100",
        "data.max_prompt_length=28",
        "rollout.vllm.tensor_parallel_size=2",
        "rollout.vllm.gpu_memory_utilization=0.35",
        "rollout.vllm.enforce_eager=true",
        "rollout.vllm.enable_sleep_mode=false",
        "rollout.vllm.max_num_seqs=64",
    )
    kw = llm_kwargs(cfg.rollout, engine_run(cfg), model_dir, weights_on_disk=False)
    assert kw["model"] == str(model_dir)
    assert (kw["tensor_parallel_size"], kw["gpu_memory_utilization"], kw["max_num_seqs"]) == (2, 0.35, 64)
    assert (kw["enforce_eager"], kw["enable_sleep_mode"], kw["seed"], kw["dtype"]) == (True, False, 11, "float32")
    assert kw["max_model_len"] == 128 and kw["load_format"] == "dummy"
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["skip_tokenizer_init"] is True
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["generation_config"] == "vllm"
    assert llm_kwargs(*engine_args(cfg_for(model_dir)), model_dir, weights_on_disk=True)["load_format"] == "auto"
    assert llm_kwargs(*engine_args(cfg_for(model_dir, "model.dtype=auto")), model_dir, True)["dtype"] == "bfloat16"
    assert "kv_cache_memory_bytes" not in kw


def test_llm_kwargs_on_cpu_float32_eager_no_sleep(model_dir):
    """Issue 19 item 2: vLLM refuses sleep mode on CPU; float32 by default there, bf16 allowed."""
    cfg = cfg_for(model_dir, "rollout.vllm.cpu_kv_cache_gib=0.5", "rollout.max_response_length=3")
    kw = llm_kwargs(cfg.rollout, engine_run(cfg), model_dir, True, device_type="cpu")
    assert (kw["dtype"], kw["enable_sleep_mode"], kw["enforce_eager"]) == ("float32", False, True)
    assert kw["kv_cache_memory_bytes"] == 2**29
    assert kw["max_model_len"] == 512 + 3
    short = cfg_for(model_dir, "data.max_prompt_length=8", "rollout.max_response_length=3")
    # the 24-token probe fits
    assert llm_kwargs(*engine_args(short), model_dir, True, device_type="cpu")["max_model_len"] == 25
    bf16 = engine_args(cfg_for(model_dir, "model.dtype=bfloat16"))
    assert llm_kwargs(*bf16, model_dir, True, device_type="cpu")["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="FP8 kernels"):
        fp8 = engine_args(cfg_for(model_dir, "rollout.quantization=fp8"))
        VLLMEngine(*fp8, model_dir=model_dir, tokenizer=None, device="cpu")
    with pytest.raises(ConfigError, match="cpu_kv_cache_gib"):
        cfg_for(model_dir, "rollout.vllm.cpu_kv_cache_gib=0")


def test_preflight_names_both_lengths_and_the_model_limit(model_dir, tmp_path):
    """Issue 19 item 3: vLLM refuses max_model_len above max_position_embeddings (a pydantic error at
    engine start); preflight says it in one line first."""
    bad = cfg_for(model_dir, "data.max_prompt_length=100", "rollout.max_response_length=40")
    with pytest.raises(ConfigError) as e:
        check_vllm_context(bad)
    msg = str(e.value)
    assert "data.max_prompt_length (100)" in msg and "rollout.max_response_length (40)" in msg
    assert "max_position_embeddings (128)" in msg and "\n" not in msg
    check_vllm_context(cfg_for(model_dir, "data.max_prompt_length=100", "rollout.max_response_length=28"))
    check_vllm_context(load_config(None, [f"model.path={model_dir}", "data.max_prompt_length=100"]))  # hf engine
    tiny = [
        f"model.path={tmp_path}/none",
        "model.init=tiny",
        "rollout.engine=vllm",
        "model.tiny.max_position_embeddings=32",
    ]
    with pytest.raises(ConfigError, match="max_position_embeddings \\(32\\)"):
        check_vllm_context(load_config(None, [*tiny, "data.max_prompt_length=30"]))


def test_sampling_kwargs():
    sp = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=-1, max_tokens=17, seed=5, stop_token_ids=(9, 4, 2))
    kw = sampling_kwargs(sp, [2], seed=123)
    assert kw == {
        "n": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "max_tokens": 17,
        "seed": 123,
        "stop_token_ids": [2, 4, 9],
        "ignore_eos": True,
        "logprobs": 0,
        "detokenize": False,
    }
    assert sampling_kwargs(SamplingParams(top_k=5), [2], seed=0)["top_k"] == 5
    with pytest.raises(ValueError, match="temperature=0"):
        sampling_kwargs(SamplingParams(temperature=0.0), [2], seed=0)
    with pytest.raises(ValueError, match="max_tokens=0"):
        sampling_kwargs(SamplingParams(max_tokens=0), [2], seed=0)
    pk = prompt_logprob_kwargs()
    assert pk["prompt_logprobs"] == 0 and pk["max_tokens"] == 1 and pk["temperature"] == 0.0


def test_request_seeds_are_reproducible_and_keep_samples_apart():
    n = 16
    seeds = {(s, k): request_seed(s, k) for s in range(40) for k in range(40)}
    assert all(request_seed(s, k) == v for (s, k), v in seeds.items())
    assert all(0 <= v < 2**56 for v in seeds.values())
    # vLLM gives sample j of a request seed + j: no two (step, prompt, sample) triples may share a stream
    streams = [v + j for v in seeds.values() for j in range(n)]
    assert len(set(streams)) == len(streams)


# ------------------------------------------------------------------------------------------ output conversion


def _lp(values: dict[int, float]) -> dict:
    return {t: SimpleNamespace(logprob=v, rank=1, decoded_token=None) for t, v in values.items()}


def _completion(index, tokens, reason, lps=None):
    logprobs = None if lps is None else [_lp({t: lp, 999: -0.01}) for t, lp in zip(tokens, lps)]
    return SimpleNamespace(index=index, token_ids=tokens, finish_reason=reason, logprobs=logprobs, text="")


def test_to_responses_orders_samples_and_maps_finish_reasons():
    outputs = [
        SimpleNamespace(
            outputs=[_completion(1, [7, 8], "length", [-1.0, -2.0]), _completion(0, [5, 2], "stop", [-0.5, -0.25])]
        ),
        SimpleNamespace(outputs=[_completion(0, [3], "stop", [-3.0]), _completion(1, [4, 4], "length", [-0.1, -0.2])]),
    ]
    seen = []

    def decode(lists):
        seen.append(lists)
        return ["|".join(map(str, t)) for t in lists]

    groups = to_responses(outputs, 2, decode)
    assert seen == [[[5, 2], [7, 8], [3], [4, 4]]]  # one decode call, index order within a prompt
    assert [[r.token_ids for r in g] for g in groups] == [[(5, 2), (7, 8)], [(3,), (4, 4)]]
    assert [[r.finish_reason for r in g] for g in groups] == [["stop", "length"], ["stop", "length"]]
    assert groups[0][0].logprobs == (-0.5, -0.25) and groups[0][1].truncated
    assert groups[1][1].text == "4|4"
    no_lp = to_responses([SimpleNamespace(outputs=[_completion(0, [1], "stop")])], 1, decode)
    assert no_lp[0][0].logprobs is None


def test_to_responses_rejects_unfinished_or_missing_samples():
    ok = _completion(0, [1], "stop", [-1.0])
    with pytest.raises(RuntimeError, match="'abort'"):
        to_responses([SimpleNamespace(outputs=[_completion(0, [1], "abort", [-1.0])])], 1, lambda x: [""] * len(x))
    with pytest.raises(RuntimeError, match="expected n=2"):
        to_responses([SimpleNamespace(outputs=[ok])], 2, lambda x: [""] * len(x))
    bad = SimpleNamespace(index=0, token_ids=[1, 2], finish_reason="stop", logprobs=[_lp({1: -1.0}), _lp({7: -1.0})])
    with pytest.raises(RuntimeError, match="no log-prob for token 2"):
        to_responses([SimpleNamespace(outputs=[bad])], 1, lambda x: [""] * len(x))


def test_prompt_logprobs_tensor_picks_the_prompt_token():
    tokens = [4, 9, 1, 6]
    plp = [None, _lp({9: -1.5, 3: -0.2}), _lp({1: -0.25}), _lp({6: -4.0, 0: -0.01})]
    out = prompt_logprobs_tensor(tokens, plp)
    assert out.dtype == torch.float32 and out.tolist() == [-1.5, -0.25, -4.0]
    assert prompt_logprobs_tensor([4], [None]).shape == (0,)
    with pytest.raises(RuntimeError, match="3 prompt log-prob positions for a 4-token"):
        prompt_logprobs_tensor(tokens, plp[:3])


# ------------------------------------------------------------------------------- the sync stream's checks


def _hf_stream(required, optional):
    return [(n, torch.zeros(1)) for n in [*sorted(required), *sorted(optional)]]


def test_expected_hf_names_of_tied_model(model_dir):
    required, optional = expected_hf_names(model_dir)
    assert optional == {"lm_head.weight"}
    assert "model.embed_tokens.weight" in required and "model.layers.1.mlp.down_proj.weight" in required
    assert not any("rotary" in n for n in required)


def test_sync_stream_drops_the_tied_alias_and_catches_unknown_repeated_missing(model_dir):
    required, optional = expected_hf_names(model_dir)
    stream = _hf_stream(required, optional)
    s = SyncStream((required, optional))
    names = [n for n, _ in s.tensors(iter_buckets(iter(stream), 1 << 6))]
    assert sorted(names) == sorted(required) and s.finish() == len(required)
    t = stream[0][1]
    assert next(SyncStream((required, optional)).tensors([[stream[0]]]))[1] is t  # no copy
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        list(SyncStream((required, optional)).tensors([[("model.layers.9.mlp.up_proj.weight", t)]]))
    with pytest.raises(ValueError, match="sent twice"):
        list(SyncStream((required, optional)).tensors([[stream[0]], [stream[0]]]))
    partial = SyncStream((required, optional))
    list(partial.tensors([stream[1:]]))
    with pytest.raises(RuntimeError, match=f"1 HF tensors never arrived.*{stream[0][0]}"):
        partial.finish()
    fp8 = SyncStream((required, optional), ("_scale",))
    list(fp8.tensors([[("model.layers.0.mlp.up_proj.weight_scale", t)]]))
    unchecked = SyncStream(None)
    assert len(list(unchecked.tensors([stream]))) == len(stream) and unchecked.finish() == len(stream)


@pytest.mark.gpu
def test_real_engine_matches_transformers_on_gpu(tmp_path, monkeypatch):
    """Written for GPU, never run (vLLM's CUDA wheel was never on a GPU machine with this project): bf16
    log-probs vs transformers, a reload sync after a level-2 sleep, a partial sync. The same engine runs
    on CPU in tests/rollout/test_vllm_cpu.py."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pacs_megatron.rollout.hf_engine import HFEngine

    shape = TinyModelConfig(
        hidden_size=256, num_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512
    )
    model_dir = write_tiny_model_dir(tmp_path / "m", shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir))).save_pretrained(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = cfg_for(
        model_dir, "model.dtype=bfloat16", "rollout.vllm.enforce_eager=true", "rollout.vllm.gpu_memory_utilization=0.3"
    )
    engine = VLLMEngine(cfg.rollout, engine_run(cfg), model_dir=model_dir, tokenizer=tok, device="cuda:0")
    ref = HFEngine(model_dir, tok, device="cpu", dtype=torch.float32)
    seqs = [[1, 5, 7, 9, 3, 4, 6], [2, 8, 8, 3]]

    def worst(a, b):
        return max(float(((x - y).abs() / y.abs().clamp(min=1.0)).max()) for x, y in zip(a, b))

    assert worst(engine.logprobs(seqs), ref.logprobs(seqs)) < 5e-2
    with torch.no_grad():  # new weights: the engine must follow them after a sleep
        for p in ref.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sleep()
    with pytest.raises(RuntimeError, match="without a weight sync"):
        engine.generate([[5]], SamplingParams(n=1, max_tokens=2, seed=1))
    state = [(n, t.to("cuda", torch.bfloat16)) for n, t in ref.model.state_dict().items() if n != "lm_head.weight"]
    assert engine.update_weights(iter_buckets(iter(state), 1 << 16)) == len(state)
    assert worst(engine.logprobs(seqs), ref.logprobs(seqs)) < 5e-2
    with pytest.raises(RuntimeError, match="never arrived"):
        engine.update_weights([state[1:]])
    engine.close()


def test_kv_cache_sized_from_memory_free_after_offload(model_dir):
    """Defect 3: with actor.offload_during_rollout vLLM gets a fraction of the memory free after the
    actor's offload, not a fixed fraction of the GPU."""
    free_total = (30 * 2**30, 80 * 2**30)
    cfg = cfg_for(model_dir, "actor.offload_during_rollout=true", "actor.rollout_memory_fraction=0.8")
    assert llm_kwargs(*engine_args(cfg), model_dir, True, free_total)["gpu_memory_utilization"] == pytest.approx(0.3)
    assert llm_kwargs(*engine_args(cfg_for(model_dir)), model_dir, True, free_total)["gpu_memory_utilization"] == 0.5
    with pytest.raises(ValueError, match="makes no sense"):
        colocated_memory_utilization(0, 80, 0.9)
