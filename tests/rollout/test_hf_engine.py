"""HF transformers engine: seeded sampling, EOS/stop/length handling, log-prob agreement, weight updates."""

import importlib.util
from dataclasses import replace

import pytest
import torch
from _forcing import force_next_token

from pacs_megatron.config import RolloutConfig, TinyModelConfig
from pacs_megatron.data.synthetic import write_tiny_model_dir
from pacs_megatron.rollout import EngineRun, build_engine
from pacs_megatron.rollout.hf_engine import HFEngine
from pacs_megatron.rollout.types import SamplingParams

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tied = write_tiny_model_dir(root / "tied", TINY)
    untied = write_tiny_model_dir(root / "untied", TinyModelConfig(**{**TINY.__dict__, "tie_word_embeddings": False}))
    return tied, untied


@pytest.fixture(scope="module")
def tok(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dirs[0]), local_files_only=True)


@pytest.fixture(scope="module")
def engine(model_dirs, tok):
    return HFEngine(model_dirs[0], tok, batch_size=2, seed=1)


def ids(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def state(eng: HFEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.model.named_parameters()}


def forced_engine(model_dir, tok, token_id: int) -> HFEngine:
    """An untied engine whose next token is ``token_id`` with probability ~1 at every position."""
    return force_next_token(HFEngine(model_dir, tok, seed=0), token_id)


def test_seeded_sampling_is_deterministic_and_shaped(engine, tok):
    prompts = ids(tok, ["3+5=", "12+4=", "7+7=", "1+0=", "9+9="])  # 5 prompts, batch_size 2: 3 generate calls
    sp = SamplingParams(n=3, temperature=0.8, top_p=0.9, top_k=8, max_tokens=5, seed=7)
    a, b = engine.generate(prompts, sp), engine.generate(prompts, sp)
    assert [len(g) for g in a] == [3] * 5
    assert a == b
    assert [[r.logprobs for r in g] for g in a] == [[r.logprobs for r in g] for g in b]
    c = engine.generate(prompts, SamplingParams(n=3, temperature=0.8, top_p=0.9, top_k=8, max_tokens=5, seed=8))
    assert [[r.token_ids for r in g] for g in a] != [[r.token_ids for r in g] for g in c]
    for g in a:
        for r in g:
            assert 1 <= len(r.token_ids) <= 5 and len(r.logprobs) == len(r.token_ids)
            assert all(lp <= 0 for lp in r.logprobs)
            assert r.finish_reason == ("stop" if r.token_ids[-1] == tok.eos_token_id else "length")
            assert tok.eos_token_id not in r.token_ids[:-1]
            assert r.text == tok.decode(list(r.token_ids), skip_special_tokens=True)
    # the global RNG of the caller is untouched by seeded generation
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine.generate(prompts[:1], sp)
    assert torch.equal(torch.rand(3), expected)


def _truncated_logprob(logits: torch.Tensor, token: int, temp: float, top_k: int, top_p: float) -> float:
    """log p(token) under softmax(logits / T) cut to the top-k, renormalised, cut to the smallest set of
    the most likely tokens whose mass reaches top_p, renormalised (written out, one position)."""
    probs = torch.softmax(logits.double() / temp, -1)
    top = probs.topk(top_k)
    p, idx = top.values / top.values.sum(), top.indices.tolist()
    keep = [i for j, i in enumerate(idx) if float(p[:j].sum()) < top_p]
    kept = probs[keep] / probs[keep].sum()
    return float(kept[keep.index(token)].log()) if token in keep else float("-inf")


def test_engine_logprobs_equal_forward_logprobs(engine, tok):
    # prompts of different lengths share a left-padded batch; the per-token log-probs of the sampled
    # tokens are those of the distribution they were drawn from (logits / T, top-k, top-p, renormalised:
    # vLLM's processed_logprobs) in a plain forward over prompt + response without padding
    prompts = ids(tok, ["3+5=", "12+34=", "7="])
    temp, top_k, top_p = 0.7, 5, 0.8
    sp = SamplingParams(n=4, temperature=temp, top_k=top_k, top_p=top_p, max_tokens=6, seed=3)
    groups = engine.generate(prompts, sp)
    seqs, expected = [], []
    for p, g in zip(prompts, groups):
        for r in g:
            seqs.append(list(p) + list(r.token_ids))
            expected.append((len(p), torch.tensor(r.logprobs)))
    got = engine.logprobs(seqs, temperature=temp)
    truncated = 0
    for (plen, lp), full, seq in zip(expected, got, seqs):
        assert full.shape == (len(seq) - 1,)
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([seq])).logits[0]
        ref = [_truncated_logprob(logits[t - 1], seq[t], temp, top_k, top_p) for t in range(plen, len(seq))]
        torch.testing.assert_close(lp.double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=0)
        assert (lp >= full[plen - 1 :] - 1e-6).all()  # renormalised: never below the untruncated log-prob
        truncated += int((lp > full[plen - 1 :] + 1e-3).sum())
    assert truncated > 0, "top-k / top-p cut nothing: the test does not compare the definitions"
    # batched (right-padded) equals one-by-one
    singles = [engine.logprobs([s], temperature=temp)[0] for s in seqs[:4]]
    for a, b in zip(singles, got[:4]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_finished_rows_leave_the_decode_batch(engine, tok):
    """A row that samples a stop token leaves the decode batch and the KV cache: a response of L tokens
    is fed to exactly L - 1 decode forwards, and the rows left running still get the log-probs of a plain
    forward over prompt + response (a wrong cache row would change them)."""
    widths: list[tuple[int, int]] = []

    def record(module, args, kwargs):  # noqa: ARG001
        widths.append(tuple(kwargs["input_ids"].shape))

    hook = engine.model.register_forward_pre_hook(record, with_kwargs=True)
    prompts = ids(tok, ["3+5=", "12+34=", "7+1="])
    stops = tuple(tok.convert_tokens_to_ids(list("0123")))  # likely tokens: rows stop at different times
    sp = SamplingParams(n=4, temperature=1.5, max_tokens=10, seed=5, stop_token_ids=stops)
    try:
        groups = engine.generate(prompts, sp)
    finally:
        hook.remove()
    lengths = [len(r.token_ids) for g in groups for r in g]
    decode_rows = [rows for rows, cols in widths if cols == 1]
    assert len(set(lengths)) > 1, "test needs responses of different lengths"
    assert sum(decode_rows) == sum(n - 1 for n in lengths)
    seqs = [list(p) + list(r.token_ids) for p, g in zip(prompts, groups) for r in g]
    got = engine.logprobs(seqs, temperature=1.5)
    for seq, full, r in zip(seqs, got, (r for g in groups for r in g)):
        torch.testing.assert_close(full[len(seq) - len(r.token_ids) - 1 :], torch.tensor(r.logprobs), atol=1e-5, rtol=0)


def test_eos_forcing_model_stops_immediately(model_dirs, tok):
    eng = forced_engine(model_dirs[1], tok, tok.eos_token_id)
    groups = eng.generate(ids(tok, ["3+5=", "1+1="]), SamplingParams(n=3, max_tokens=8, seed=0))
    for g in groups:
        for r in g:
            assert r.token_ids == (tok.eos_token_id,)
            assert r.finish_reason == "stop" and r.text == "" and not r.truncated
            assert r.logprobs[0] > -1e-6


def test_stop_token_ids_and_length_truncation(model_dirs, tok):
    plus = tok.convert_tokens_to_ids("+")
    eng = forced_engine(model_dirs[1], tok, plus)
    stopped = eng.generate(ids(tok, ["3+5="]), SamplingParams(n=2, max_tokens=8, seed=0, stop_token_ids=(plus,)))
    assert [(r.token_ids, r.finish_reason, r.text) for r in stopped[0]] == [((plus,), "stop", "+")] * 2
    long = eng.generate(ids(tok, ["3+5=", "4="]), SamplingParams(n=2, max_tokens=4, seed=0))
    for g in long:
        for r in g:
            assert r.token_ids == (plus,) * 4 and r.finish_reason == "length" and r.truncated and r.text == "++++"


def test_stop_strings_end_a_response_with_the_completing_token(model_dirs, tok, engine):
    plus = tok.convert_tokens_to_ids("+")
    eng = forced_engine(model_dirs[1], tok, plus)
    [g] = eng.generate(ids(tok, ["3+5="]), SamplingParams(n=2, max_tokens=8, seed=0, stop=("+++", "=")))
    assert [(r.token_ids, r.finish_reason, r.text) for r in g] == [((plus,) * 3, "stop", "+++")] * 2
    assert all(len(r.logprobs) == 3 for r in g)
    # rows that stop on a string leave the batch while the others go on; lengths come out per row
    sp = SamplingParams(n=4, max_tokens=12, seed=3, stop=("5",))
    for r in (r for g in engine.generate(ids(tok, ["3+5=", "9+9="]), sp) for r in g):
        text = tok.decode(list(r.token_ids), skip_special_tokens=False)
        if r.finish_reason == "stop" and "5" in text:
            assert text.endswith("5") and text.count("5") == 1
        else:
            assert "5" not in text


def test_top_k_one_is_greedy(engine, tok):
    g = engine.generate(ids(tok, ["2+2="]), SamplingParams(n=3, top_k=1, max_tokens=4, seed=0))[0]
    assert g[0].token_ids == g[1].token_ids == g[2].token_ids
    seq = ids(tok, ["2+2="])[0] + list(g[0].token_ids)
    logits = engine.model(input_ids=torch.tensor([seq])).logits[0]
    assert list(g[0].token_ids) == logits[3 : 3 + len(g[0].token_ids)].argmax(-1).tolist()


def test_update_weights_round_trip_and_errors(model_dirs, tok):
    src = HFEngine(model_dirs[0], tok, seed=11)
    torch.manual_seed(99)  # the engine's random init draws from the global RNG
    dst = HFEngine(model_dirs[0], tok, seed=22)
    seqs = ids(tok, ["12+34=46", "9+9=18 "])
    assert not torch.allclose(src.logprobs(seqs)[0], dst.logprobs(seqs)[0])
    sd = state(src)
    assert "lm_head.weight" not in sd  # tied: one tensor under the embedding's name
    items = [(n, t.to(torch.float64)) for n, t in sd.items()]  # dtype is cast on copy
    items.append(("lm_head.weight", sd["model.embed_tokens.weight"]))  # tied alias accepted
    buckets = [items[i : i + 5] for i in range(0, len(items), 5)]
    assert dst.update_weights(iter(buckets)) == len(sd)
    for a, b in zip(src.logprobs(seqs), dst.logprobs(seqs)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)

    with pytest.raises(KeyError, match="model.layers.0.mlp.nonexistent.weight"):
        dst.update_weights([[("model.layers.0.mlp.nonexistent.weight", torch.zeros(1))]])
    with pytest.raises(ValueError, match="shape"):
        dst.update_weights([[("model.norm.weight", torch.zeros(7))]])
    partial = [(n, t) for n, t in sd.items() if n != "model.norm.weight"]
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        dst.update_weights([partial])


def test_sleep_wake_noop_on_cpu(engine, tok):
    before = engine.logprobs(ids(tok, ["1+2=3"]))[0]
    engine.sleep()
    engine.wake()
    assert torch.equal(engine.logprobs(ids(tok, ["1+2=3"]))[0], before)


def test_build_engine_factory(model_dirs, tok):
    rollout, run = RolloutConfig(batch_size=3), EngineRun(dtype="auto", max_prompt_length=512)
    eng = build_engine(rollout, run, model_dirs[0], tok, device="cpu")
    assert isinstance(eng, HFEngine) and eng.batch_size == 3 and eng.dtype == torch.float32
    bf16 = replace(run, dtype="bfloat16")
    assert build_engine(rollout, bf16, model_dirs[0], tok, device="cpu").dtype == torch.bfloat16
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(RuntimeError, match="vllm is not installed"):
            build_engine(RolloutConfig(engine="vllm"), run, model_dirs[0], tok, device="cpu")


def test_bad_inputs_raise_clear_errors(engine, tok, tmp_path):
    with pytest.raises(ValueError, match="no tokens"):
        engine.generate([[3], []], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate([[3]], SamplingParams(max_tokens=0))
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFEngine(tmp_path, tok)


def test_the_kv_cache_goes_by_the_name_the_model_takes(model_dirs, tok, monkeypatch):
    """Issue 29: transformers >= 5.24 renamed forward's ``past_key_values`` to ``cache`` and warns (a
    FutureWarning per call site: two in every run's log). The engine passes the name the forward takes;
    with a forward that takes only ``cache`` the old keyword is refused here, and the samples are the same."""
    from transformers import Qwen2ForCausalLM

    before = HFEngine(model_dirs[0], tok, batch_size=2, seed=1)
    prompts = ids(tok, ["1+2=", "3+4="])
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=5)
    expected = before.generate(prompts, sampling)
    original = Qwen2ForCausalLM.forward

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None, **kw):
        assert "past_key_values" not in kw, "the deprecated keyword reached the model"
        return original(self, input_ids, attention_mask, position_ids, past_key_values=cache, use_cache=use_cache, **kw)

    monkeypatch.setattr(Qwen2ForCausalLM, "forward", forward)
    after = HFEngine(model_dirs[0], tok, batch_size=2, seed=1)
    after.update_weights([list(state(before).items())])  # a random init: give it the same weights
    got = after.generate(prompts, sampling)
    assert [[r.token_ids for r in g] for g in got] == [[r.token_ids for r in g] for g in expected]
