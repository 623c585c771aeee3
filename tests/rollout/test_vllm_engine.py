"""vLLM engine: everything that does not need a GPU, on fakes of vLLM's objects; plus one GPU test.

The fakes follow vLLM 0.32's shapes: ``RequestOutput.outputs`` (``CompletionOutput`` with ``index``,
``token_ids``, ``finish_reason``, ``logprobs`` = one ``{token: Logprob}`` dict per generated token),
``RequestOutput.prompt_logprobs`` (None at position 0), and a Qwen2 model whose ``load_weights`` fuses
q/k/v and gate/up into vLLM's parameter names and returns the names it loaded.

GPU (never run so far): ``pytest -m gpu tests/rollout/test_vllm_engine.py`` on a machine with vllm 0.32.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from pacs_megatron.config import TinyModelConfig, load_config
from pacs_megatron.data.synthetic import write_tiny_model_dir
from pacs_megatron.rollout import build_engine
from pacs_megatron.rollout.types import SamplingParams
from pacs_megatron.rollout.vllm_engine import (
    VLLMEngine,
    colocated_memory_utilization,
    llm_kwargs,
    prompt_logprob_kwargs,
    prompt_logprobs_tensor,
    request_seed,
    sampling_kwargs,
    to_responses,
    vllm_replica,
)
from pacs_megatron.weight_sync import iter_buckets
from pacs_megatron.weight_sync.vllm_push import VLLMWeightLoader, expected_hf_names

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
    kw = llm_kwargs(cfg, model_dir, weights_on_disk=False)
    assert kw["model"] == str(model_dir)
    assert (kw["tensor_parallel_size"], kw["gpu_memory_utilization"], kw["max_num_seqs"]) == (2, 0.35, 64)
    assert (kw["enforce_eager"], kw["enable_sleep_mode"], kw["seed"], kw["dtype"]) == (True, False, 11, "float32")
    assert kw["max_model_len"] == 128 and kw["load_format"] == "dummy"
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["skip_tokenizer_init"] is True
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["generation_config"] == "vllm"
    assert llm_kwargs(cfg_for(model_dir), model_dir, weights_on_disk=True)["load_format"] == "auto"
    assert llm_kwargs(cfg_for(model_dir, "model.dtype=auto"), model_dir, True)["dtype"] == "bfloat16"


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


# ------------------------------------------------------------------------------------- weight loading (fake)

_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
_STACKED |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class FakeVLLMQwen2:
    """vLLM's Qwen2 parameter names (fused qkv / gate_up; tied LM head not a separate parameter)."""

    def __init__(self, hf_names, drop_param: str | None = None):
        self.params = set()
        for name in hf_names:
            if name == "lm_head.weight":
                continue
            self.params.add(self._vllm_name(name))
        self.drop_param = drop_param  # a parameter load_weights "forgets" to report
        self.calls: list[list[tuple[str, torch.Tensor]]] = []

    @staticmethod
    def _vllm_name(name):
        for part, (fused, _) in _STACKED.items():
            if f".{part}." in name:
                return name.replace(part, fused)
        return name

    def load_weights(self, weights):
        bucket = list(weights)
        self.calls.append(bucket)
        if any(n == "lm_head.weight" for n, _ in bucket):
            raise ValueError("'lm_head.weight' was skipped because it is tied to 'model.embed_tokens.weight'")
        return {self._vllm_name(n) for n, _ in bucket} - {self.drop_param}

    def named_parameters(self):
        return [(n, None) for n in sorted(self.params)]


def _hf_stream(required, optional):
    return [(n, torch.full((2,), float(i))) for i, n in enumerate(sorted(required | optional))]


def test_expected_hf_names_of_tied_model(model_dir):
    required, optional = expected_hf_names(model_dir)
    assert optional == {"lm_head.weight"}
    assert "model.embed_tokens.weight" in required and "model.layers.1.self_attn.k_proj.bias" in required
    assert len(required) == 1 + TINY.num_layers * 12 + 1


def test_loader_streams_buckets_without_copies_and_drops_tied_alias(model_dir):
    required, optional = expected_hf_names(model_dir)
    model = FakeVLLMQwen2(required)
    stream = _hf_stream(required, optional)
    loader = VLLMWeightLoader(lambda fn: [fn(model)], (required, optional))
    count = loader.load(iter_buckets(iter(stream), bucket_bytes=24))  # 8 bytes per tensor: 3 per bucket
    assert count == len(required)
    chunks = [[n for n, _ in stream[i : i + 3] if n not in optional] for i in range(0, len(stream), 3)]
    assert [[n for n, _ in c] for c in model.calls] == [c for c in chunks if c]  # one load_weights per bucket
    sent = {n: t for c in model.calls for n, t in c}
    assert "lm_head.weight" not in sent and set(sent) == required
    originals = dict(stream)
    assert all(sent[n] is originals[n] for n in sent)  # handed over as they came: no copy, no host round trip


def test_loader_catches_missing_unknown_and_unwritten(model_dir):
    required, optional = expected_hf_names(model_dir)
    stream = _hf_stream(required, optional)
    k1 = "model.layers.1.self_attn.k_proj.weight"
    model = FakeVLLMQwen2(required)
    loader = VLLMWeightLoader(lambda fn: [fn(model)], (required, optional))
    # qkv_proj is still reported loaded (q and v arrived): only the HF-name check sees the hole
    with pytest.raises(RuntimeError, match=re.escape(f"1 HF tensors never arrived: ['{k1}']")):
        loader.load([[(n, t) for n, t in stream if n != k1]])
    model.calls.clear()
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        loader.load([stream[:2], [("model.layers.9.mlp.up_proj.weight", torch.zeros(2))]])
    assert len(model.calls) == 1  # the bad bucket was refused before loading
    lost = "model.norm.weight"
    forgetful = FakeVLLMQwen2(required, drop_param=lost)
    two_workers = VLLMWeightLoader(lambda fn: [fn(FakeVLLMQwen2(required)), fn(forgetful)], (required, optional))
    with pytest.raises(RuntimeError, match=f"worker 1 left 1 parameters unwritten: \\['{lost}'\\]"):
        two_workers.load([stream])
    # without HF names (unknown architecture) the vLLM-parameter check alone still catches a dropped tensor
    vllm_only = VLLMWeightLoader(lambda fn: [fn(FakeVLLMQwen2(required))], None)
    with pytest.raises(RuntimeError, match="unwritten: \\['model.norm.weight'\\]"):
        vllm_only.load([[(n, t) for n, t in stream if n not in optional and n != lost]])


# ------------------------------------------------------------------------------------ engine on a fake vllm


class FakeLLM:
    instances: list[FakeLLM] = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        self.model = None
        FakeLLM.instances.append(self)

    def apply_model(self, fn):
        return [fn(self.model)]

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", prompts, params))
        if isinstance(params, dict) and params.get("prompt_logprobs") == 0:
            return [
                SimpleNamespace(
                    prompt_logprobs=[None] + [_lp({t: -0.5 * i}) for i, t in enumerate(p["prompt_token_ids"][1:], 1)]
                )
                for p in prompts
            ]
        return [
            SimpleNamespace(outputs=[_completion(j, [3 + j, 2], "stop", [-1.0, -2.0]) for j in range(sp["n"])])
            for sp in params
        ]

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeLLM.instances.clear()
    module = SimpleNamespace(__version__="0.32.0", LLM=FakeLLM, SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    for k, v in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(k, v)
    return module


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def test_engine_wiring_on_fake_vllm(fake_vllm, model_dir, tok):
    engine = VLLMEngine(cfg=cfg_for(model_dir, "rollout.seed=3"), model_dir=model_dir, tokenizer=tok, device="cuda")
    llm = FakeLLM.instances[-1]
    assert (engine.dp_rank, engine.dp_size) == (0, 1)
    assert llm.kwargs["load_format"] == "dummy" and llm.kwargs["seed"] == 3  # config.json only: dummy weights
    groups = engine.generate([[5, 6], [7]], SamplingParams(n=2, max_tokens=4, seed=10))
    _, prompts, params = llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}]
    assert [p["seed"] for p in params] == [request_seed(10, 0), request_seed(10, 1)]
    assert all(p["stop_token_ids"] == [tok.eos_token_id] and p["ignore_eos"] for p in params)
    assert [[r.token_ids for r in g] for g in groups] == [[(3, 2), (4, 2)]] * 2
    assert groups[0][0].text == tok.decode([3, 2], skip_special_tokens=True)
    lps = engine.logprobs([[1, 2, 3]])
    assert lps[0].tolist() == [-0.5, -1.0]
    with pytest.raises(ValueError, match="temperature"):
        engine.logprobs([[1, 2, 3]], temperature=0.5)
    # weights: asleep -> only the weights wake; the KV cache wakes at the next generate
    required, optional = expected_hf_names(model_dir)
    llm.model = FakeVLLMQwen2(required)
    engine.sleep()
    assert engine.update_weights([_hf_stream(required, optional)]) == len(required)
    assert llm.calls[-2:] == [("sleep", 2), ("wake_up", ["weights"])]
    engine.generate([[5]], SamplingParams(n=1, max_tokens=2, seed=1))
    assert llm.calls[-2][:2] == ("wake_up", ["kv_cache"])
    engine.update_weights([_hf_stream(required, optional)])  # awake: stale prefix KV must go
    assert llm.calls[-1] == ("reset_prefix_cache",)


def test_engine_sleep_is_a_noop_without_sleep_mode(fake_vllm, model_dir, tok):
    cfg = cfg_for(model_dir, "rollout.vllm.enable_sleep_mode=false")
    engine = VLLMEngine(cfg=cfg, model_dir=model_dir, tokenizer=tok, device="cuda")
    engine.sleep()
    engine.wake()
    assert FakeLLM.instances[-1].calls == []


def test_clear_errors_without_gpu_vllm_or_launcher(monkeypatch, fake_vllm, model_dir, tok):
    cfg = cfg_for(model_dir)
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu: use rollout.engine=hf"):
        VLLMEngine(cfg=cfg, model_dir=model_dir, tokenizer=tok, device="cpu")
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(RuntimeError, match="MASTER_PORT"):
        VLLMEngine(cfg=cfg, model_dir=model_dir, tokenizer=tok, device="cuda")
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ImportError, match="rollout.engine=vllm needs vllm"):
        VLLMEngine(cfg=cfg, model_dir=model_dir, tokenizer=tok, device="cuda")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RuntimeError, match="vllm is not installed"):
        build_engine(cfg, model_dir, tok, "cuda")


# ------------------------------------------------------------------------------------------------------ GPU


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gpu
def test_real_engine_matches_transformers(tmp_path, monkeypatch):
    """Written for GPU, never run here: vLLM log-probs vs transformers, a weight round trip, sleep/wake."""
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
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    cfg = cfg_for(
        model_dir, "model.dtype=bfloat16", "rollout.vllm.enforce_eager=true", "rollout.vllm.gpu_memory_utilization=0.3"
    )
    engine = VLLMEngine(cfg=cfg, model_dir=model_dir, tokenizer=tok, device="cuda:0")
    ref = HFEngine(model_dir, tok, device="cpu", dtype=torch.float32)
    seqs = [[1, 5, 7, 9, 3, 4, 6], [2, 8, 8, 3]]

    def worst(a, b):
        return max(float(((x - y).abs() / y.abs().clamp(min=1.0)).max()) for x, y in zip(a, b))

    assert worst(engine.logprobs(seqs), ref.logprobs(seqs)) < 5e-2
    groups = engine.generate([seqs[0]], SamplingParams(n=3, max_tokens=5, seed=1))
    assert len(groups[0]) == 3 and all(1 <= len(r.token_ids) <= 5 for r in groups[0])
    assert groups == engine.generate([seqs[0]], SamplingParams(n=3, max_tokens=5, seed=1))
    with torch.no_grad():  # new weights: the engine must follow them after a sleep
        for p in ref.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sleep()
    state = [(n, t.to("cuda", torch.bfloat16)) for n, t in ref.model.state_dict().items() if n != "lm_head.weight"]
    assert engine.update_weights(iter_buckets(iter(state), 1 << 16)) == len(state)
    assert worst(engine.logprobs(seqs), ref.logprobs(seqs)) < 5e-2
    with pytest.raises(RuntimeError, match="never arrived"):
        engine.update_weights([state[1:]])


def test_level2_sleep_needs_a_sync_before_waking(fake_vllm, model_dir, tok):
    """Defect 5: level-2 sleep drops the weights, so waking without update_weights must fail loudly."""
    engine = VLLMEngine(cfg=cfg_for(model_dir), model_dir=model_dir, tokenizer=tok, device="cuda")
    llm = FakeLLM.instances[-1]
    engine.sleep()
    with pytest.raises(RuntimeError, match="without a weight sync"):
        engine.generate([[5]], SamplingParams(n=1, max_tokens=2, seed=1))
    required, optional = expected_hf_names(model_dir)
    llm.model = FakeVLLMQwen2(required)
    engine.update_weights([_hf_stream(required, optional)])
    engine.generate([[5]], SamplingParams(n=1, max_tokens=2, seed=1))
    assert [c[0] for c in llm.calls].count("sleep") == 1


def test_kv_cache_sized_from_memory_free_after_offload(model_dir):
    """Defect 3: with actor.offload_during_rollout vLLM gets a fraction of the memory free after the
    actor's offload, not a fixed fraction of the GPU."""
    free_total = (30 * 2**30, 80 * 2**30)
    cfg = cfg_for(model_dir, "actor.offload_during_rollout=true", "actor.rollout_memory_fraction=0.8")
    assert llm_kwargs(cfg, model_dir, True, free_total)["gpu_memory_utilization"] == pytest.approx(0.3)
    assert llm_kwargs(cfg_for(model_dir), model_dir, True, free_total)["gpu_memory_utilization"] == 0.5
    with pytest.raises(ValueError, match="makes no sense"):
        colocated_memory_utilization(0, 80, 0.9)
