"""The multi-turn turn loop (rollout/multi_turn.py) over a scripted engine: tool calls, tool turns rendered by the
chat template and masked off the policy, the token budget, malformed calls, the turn limit and the metrics."""

from __future__ import annotations

import pytest
from _ascii import CHATML, ascii_tokenizer

from pacs_megatron.config.base import ConfigError
from pacs_megatron.config.multi_turn import MultiTurnConfig
from pacs_megatron.data.records import PromptRecord
from pacs_megatron.envs.result import ToolResult
from pacs_megatron.rollout.base import ChecksumReader, EngineTraits, RolloutEngine
from pacs_megatron.rollout.collect import step_seed
from pacs_megatron.rollout.multi_turn import HermesFormat, MultiTurnEngine, ToolTurn, tool_access, turn_metrics
from pacs_megatron.rollout.types import Response, SamplingParams

TOK = ascii_tokenizer()
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'


class ScriptedEngine:
    """Answers by reading its context: a call first, the tool's answer once it has one. Past a stop string it
    keeps writing (``tail``), as an engine that does not stop on strings would; the loop must cut it there."""

    def __init__(self, first: str = CALL, tail: str = "junk", always_call: bool = False) -> None:
        self.first, self.tail, self.always_call, self.calls = first, tail, always_call, []
        self.replica = EngineTraits()  # what the wrapper must pass through
        self.loaded: list = []
        self.cache = False  # report prefix-cache hits, as vLLM does

    def traits(self) -> EngineTraits:
        return self.replica

    def update_weights(self, buckets) -> int:
        self.loaded += [n for b in buckets for n, _ in b]
        return len(self.loaded)

    def logprobs(self, token_ids, temperature=1.0):
        return [[-1.0] * (len(s) - 1) for s in token_ids]

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...

    def generate(self, prompts, sampling: SamplingParams) -> list[list[Response]]:
        self.calls.append((len(prompts), sampling))
        out = []
        for p in prompts:
            text = TOK.decode(list(p))
            if self.always_call or "<|im_start|>tool" not in text:
                reply, reason = self.first + self.tail, "stop"
            else:
                answer = text.rsplit("<|im_start|>tool\n", 1)[-1].split("<|im_end|>")[0].strip()
                reply, reason = f"So \\boxed{{{answer}}}", "stop"
            ids = [*TOK.encode(reply, add_special_tokens=False), TOK.eos_token_id]
            if len(ids) > sampling.max_tokens:
                ids, reason = ids[: sampling.max_tokens], "length"
            lps = tuple(-0.01 * (i + 1) for i in range(len(ids)))
            cached = len(p) - len(p) % 16 if self.cache else None  # whole 16-token blocks, as vLLM caches
            out.append([Response(tuple(ids), TOK.decode(ids), reason, lps, cached_tokens=cached)] * sampling.n)
        return out


class FakePool:
    """A stand-in for the sandbox pool (envs/pool.py): evaluates the one expression the scripted call prints."""

    closed = False

    def run(self, calls):
        out = []
        for name, args in calls:
            code = args["code"]
            if name == "python" and code.startswith("print("):
                out.append(ToolResult(str(eval(code[6:-1])), "ok", 0.5, name))
            elif name == "python" and code == "sleep":
                out.append(ToolResult("Error: timed out after 20 s", "timeout", 20.0, name))
            else:
                out.append(ToolResult("Error: unknown tool", "bad_call", 0.0, name))
        return out

    def close(self):
        self.closed = True


def engine(first=CALL, max_turns=3, **kw) -> tuple[MultiTurnEngine, ScriptedEngine]:
    inner = ScriptedEngine(first, **kw)
    return MultiTurnEngine(inner, TOK, MultiTurnConfig(max_turns=max_turns), FakePool(), use_template=True), inner


def prompt(text="What is 6*7?"):
    text = TOK.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return TOK.encode(text, add_special_tokens=False)


def test_a_call_runs_the_tool_and_its_turn_is_context_not_policy():
    mt, inner = engine()
    [[r, r2]] = mt.generate([prompt()], SamplingParams(n=2, max_tokens=400, seed=5))
    assert r == r2 and r.finish_reason == "stop"
    text = TOK.decode(list(r.token_ids))
    tool_turn = "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert text == CALL + tool_turn + "So \\boxed{42}<|im_end|>"  # "junk" after the stop string is cut
    mask = r.policy_mask
    policy = TOK.decode([t for t, m in zip(r.token_ids, mask) if m], skip_special_tokens=False)
    tool = TOK.decode([t for t, m in zip(r.token_ids, mask) if not m], skip_special_tokens=False)
    assert policy == CALL + "So \\boxed{42}<|im_end|>" and tool == tool_turn
    assert len(r.logprobs) == r.policy_tokens == sum(mask)
    assert r.text == CALL + "So \\boxed{42}"  # the verifier reads the policy's words only
    assert r.turns.turns == 2 and r.turns.tool_calls == 1 and r.turns.tool_errors == 0
    assert "42" in r.turns.transcript
    # round 0: one request for the prompt's n samples; round 1: each sample its own context, n=1, new seed
    assert [(k, s.n, s.seed) for k, s in inner.calls] == [(1, 2, 5), (2, 1, 5 + 7_919)]
    assert all("</tool_call>" in s.stop for _, s in inner.calls)


def test_the_wrapper_is_the_engine_for_traits_weights_and_steps():
    """Its traits, weights and probe are the wrapped engine's (no attribute is forwarded by name); a step's
    rollouts are sharded over the turn loop, seeded as the wrapped engine's replica would be."""
    mt, inner = engine()
    inner.replica = EngineTraits(replica=3, replicas=4, loads_in_place=True)
    assert mt.traits() == inner.traits() and isinstance(mt, RolloutEngine)
    assert mt.update_weights([[("w", None)]]) == 1 and inner.loaded == ["w"]
    assert mt.logprobs([[1, 2, 3]]) == [[-1.0, -1.0]]
    assert isinstance(mt, ChecksumReader) and mt.weight_checksums() is None  # the wrapped one cannot be read
    inner.weight_checksums = lambda: ["held"]
    assert mt.weight_checksums() == ["held"]
    inner.replica = EngineTraits()  # one replica: this process samples every prompt
    sampling = SamplingParams(n=2, max_tokens=400, seed=5)
    [[r, _]] = mt.generate_step([prompt()], sampling, step=4)
    assert r.turns.tool_calls == 1 and "\\boxed{42}" in r.text  # the turn loop ran
    assert inner.calls[-2][1].seed == step_seed(5, 4, 0)  # round 0 with the replica's step seed


def test_the_budget_counts_tool_tokens_and_ends_as_length():
    mt, _ = engine()
    full = mt.generate([prompt()], SamplingParams(n=1, max_tokens=400))[0][0]
    for budget in (len(CALL) - 5, len(CALL) + 10, len(full.token_ids) - 2):
        [[r]] = mt.generate([prompt()], SamplingParams(n=1, max_tokens=budget))
        assert r.finish_reason == "length" and len(r.token_ids) == budget, budget
        assert len(r.logprobs) == r.policy_tokens


def test_malformed_calls_and_unknown_tools_answer_with_an_error_and_count():
    bad = '<tool_call>{"name": "python", "arguments": </tool_call>'
    mt, _ = engine(first=bad)
    [[r]] = mt.generate([prompt()], SamplingParams(n=1, max_tokens=600))
    assert r.turns.tool_calls == 1 and r.turns.tool_errors == 1
    assert "not valid JSON" in r.turns.transcript
    mt, _ = engine(first='<tool_call>{"name": "shell", "arguments": {"code": "ls"}}</tool_call>')
    [[r]] = mt.generate([prompt()], SamplingParams(n=1, max_tokens=600))
    assert r.turns.tool_errors == 1 and "Error: unknown tool" in r.turns.transcript


def record(ids, tools, rid="p1"):
    return PromptRecord(rid, "q", "q", tuple(ids), "42", "mine", tools=tools)


def test_a_prompt_calls_only_the_tools_its_row_names():
    mt, _ = engine()
    mine, none, every = prompt("What is 6*7?"), prompt("What is 6*7 then?"), prompt("And 6*7?")
    mt.access = tool_access([record(mine, ("python",)), record(none, (), "p2"), record(every, None, "p3")])
    assert mt.access == {tuple(mine): ("python",), tuple(none): ()}  # None: every enabled tool, not listed
    [[ok], [refused], [free]] = mt.generate([mine, none, every], SamplingParams(n=1, max_tokens=600))
    assert ok.turns.tool_errors == 0 and "\\boxed{42}" in ok.text and free.turns.tool_errors == 0
    assert refused.turns.tool_calls == 1 and refused.turns.tool_errors == 1
    assert "no tool 'python' here; this problem's tools are []" in refused.turns.transcript
    with pytest.raises(ValueError, match="same prompt but different tools"):
        tool_access([record(mine, ("python",)), record(mine, ("search",), "p2")])


def test_the_last_turn_runs_no_call_and_the_metrics():
    always = ScriptedEngine(tail="", always_call=True)
    mt = MultiTurnEngine(always, TOK, MultiTurnConfig(max_turns=2), FakePool(), use_template=True)
    [[r]] = mt.generate([prompt()], SamplingParams(n=1, max_tokens=600))
    assert r.turns.turns == 2 and r.turns.tool_calls == 1 and r.finish_reason == "stop"
    assert TOK.decode(list(r.token_ids)).endswith("</tool_call>")  # closed in the last turn: not run
    single = Response((1, 2), "x", "stop")
    m = turn_metrics([r, r])
    assert m["tools/calls_mean"] == 1 and m["tools/call_rate"] == 1 and m["tools/error_rate"] == 0
    assert m["tools/seconds_mean"] == 0.5 and turn_metrics([single]) == {}
    assert m["tools/timeout_rate"] == 0 and "tools/prefix_cache_hit_rate" not in m  # the engine said nothing
    slow, _ = engine(first='<tool_call>{"name": "python", "arguments": {"code": "sleep"}}</tool_call>')
    [[r]] = slow.generate([prompt()], SamplingParams(n=1, max_tokens=600))
    assert r.turns.tool_timeouts == 1 == r.turns.tool_errors and turn_metrics([r])["tools/timeout_rate"] == 1


def test_prefix_cache_reuse_is_counted_over_the_resent_context():
    mt, inner = engine()
    inner.cache = True
    [[r]] = mt.generate([prompt()], SamplingParams(n=1, max_tokens=400))
    context = len(prompt()) + r.token_ids.index(TOK.encode("So", add_special_tokens=False)[0])  # before round 1
    assert r.turns.resent_tokens == context and r.turns.cached_tokens == context - context % 16
    assert turn_metrics([r])["tools/prefix_cache_hit_rate"] == (context - context % 16) / context


def test_hermes_parse_and_tool_turns_without_a_template():
    f = HermesFormat()
    assert f.parse('x <tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>') == (
        "python",
        {"code": "1"},
    )
    assert "without" in f.parse("</tool_call>")
    assert "JSON object" in f.parse('<tool_call>{"name": "p", "arguments": 3}</tool_call>')
    raw = ToolTurn(TOK, use_template=False)
    assert raw.text("7") == "\n<tool_response>\n7\n</tool_response>\n"
    assert (
        ToolTurn(TOK, use_template=True).text("7")
        == "<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_cannot_render_a_tool_turn_is_one_line():
    no_tool = CHATML.replace("{%- for m in messages -%}", "{%- for m in messages if m['role'] != 'tool' -%}")
    with pytest.raises(ValueError, match="does not render a tool message"):
        ToolTurn(ascii_tokenizer(no_tool), use_template=True)
    raising = "{{ raise_exception('no tools') }}"
    with pytest.raises(ValueError, match="cannot render a tool turn"):
        ToolTurn(ascii_tokenizer(raising), use_template=True)


def test_config_checks():
    with pytest.raises(ConfigError, match="max_turns=1"):
        MultiTurnConfig(max_turns=1)
    with pytest.raises(ConfigError, match="format"):
        MultiTurnConfig(max_turns=2, format="xml")
    assert not MultiTurnConfig().enabled and MultiTurnConfig(max_turns=4).enabled
    from pacs_megatron.config.run import load_config

    on = ["rollout.multi_turn.max_turns=3"]
    for extra, field in (
        (["tools.enabled=[]"], "tools.enabled"),
        (["actor.routing_replay=rollout"], "actor.routing_replay"),
        (["rollout.placement=separate"], "trainer.sft_warmup_steps"),
    ):
        with pytest.raises(ConfigError, match=field):
            load_config("examples/configs/cpu_tiny.yaml", [*on, *extra])
