"""Multi-turn, tool-integrated rollouts: a :class:`~pacs_megatron.rollout.base.Generator` that runs the turn
loop over any engine, so training, validation, eval and the engine processes of the asynchronous loop get
trajectories through the one ``generate`` call they already make.

One trajectory per sample (a prompt's ``n`` samples diverge at their first token)::

    round 0      engine.generate(prompts, n, stop="</tool_call>")  -> n samples per prompt
    each round   a sample that closed a call: parse it, run the tool (the pool, all calls of the round at
                 once), append the tool turn as the chat template renders it (context: policy_mask False)
                 engine.generate(every waiting sample's context, n=1, stop=...)   one batch, not one each
    ends         EOS, the token budget (rollout.max_response_length, policy + tool tokens: "length"), or
                 rollout.multi_turn.max_turns assistant turns

The result is a :class:`Response` per sample whose ``token_ids`` hold every turn, ``policy_mask`` which of
them the policy sampled and ``logprobs`` the engine's values of those only, so the batch (batch/build.py)
puts tool output in the forward pass and off every loss. A round waits for its slowest tool call (bounded
by the sandbox's wall limit); every sample generating in a round is batched with the others, and vLLM's
prefix cache keeps each context's KV across turns (the context only grows).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pacs_megatron.config.multi_turn import MultiTurnConfig
from pacs_megatron.data.records import PromptRecord
from pacs_megatron.rollout.base import ChecksumReader, EngineTraits, NamedTensors, RolloutEngine
from pacs_megatron.rollout.collect import ShardedSteps
from pacs_megatron.rollout.stop_tokens import stop_string_cut
from pacs_megatron.rollout.types import Response, SamplingParams

if TYPE_CHECKING:
    import torch

    from pacs_megatron.config import DataConfig
    from pacs_megatron.config.tools import ToolsConfig
    from pacs_megatron.envs.pool import ToolPool
    from pacs_megatron.rollout.weight_checksum import Held


@dataclass
class TurnStats:
    """One trajectory's counters (per-step means in metrics.jsonl: :func:`turn_metrics`)."""

    turns: int = 0
    """Assistant turns generated."""
    tool_calls: int = 0
    """Calls run (parsed or not: a malformed call is answered with its error)."""
    tool_errors: int = 0
    """Calls that failed: unparsable, unknown tool, or the tool's own error / timeout."""
    tool_timeouts: int = 0
    """Calls the sandbox stopped at its wall limit (``tools.wall_seconds``; counted among the errors too)."""
    tool_seconds: float = 0.0
    """Wall time of this trajectory's calls."""
    generate_seconds: float = 0.0
    """Wall time of the generate calls this trajectory was part of (shared with the samples batched with it)."""
    resent_tokens: int = 0
    """Context tokens sent again after a tool turn (every round after the first re-sends the whole context)."""
    cached_tokens: int | None = None
    """How many of ``resent_tokens`` the engine's prefix cache served (vLLM); None where the engine does not say."""
    transcript: str = ""
    """Every turn's text, tool output included (what rollouts.jsonl shows)."""


class HermesFormat:
    """``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`` (Qwen / Hermes templates)."""

    open, close = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str, dict] | str:
        """The call closed at the end of ``text`` as ``(name, arguments)``, or the error the policy is told."""
        body = text[: text.rfind(self.close)]
        start = body.rfind(self.open)
        if start < 0:
            return f"Error: {self.close} without {self.open}"
        try:
            call = json.loads(body[start + len(self.open) :])
        except json.JSONDecodeError as e:
            return f"Error: the tool call is not valid JSON ({e.msg} at character {e.pos})"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return 'Error: a tool call is {"name": ..., "arguments": {...}}'
        args = call.get("arguments", {})
        return (call["name"], args) if isinstance(args, dict) else "Error: arguments must be a JSON object"


class ToolTurn:
    """How a tool's output enters the context: the chat template's rendering of a ``tool`` message after the
    assistant turn (closing that turn and opening the next), or raw ``<tool_response>`` text without one."""

    _MARK, _OUT = "\x00assistant\x00", "\x00output\x00"

    def __init__(self, tokenizer: Any, use_template: bool) -> None:
        self.head, self.tail = "\n<tool_response>\n", "\n</tool_response>\n"
        if use_template:
            self.head, self.tail = self.split_template(tokenizer)

    @classmethod
    def split_template(cls, tokenizer: Any) -> tuple[str, str]:
        """(text before, text after) the tool output; ValueError in one line when the template cannot."""
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": cls._MARK}]
        try:
            text = tokenizer.apply_chat_template(
                [*msgs, {"role": "tool", "content": cls._OUT}], tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # jinja raises its own types (a template that refuses the role, ...)
            raise ValueError(f"the chat template cannot render a tool turn ({type(e).__name__}: {e})") from e
        if text.count(cls._MARK) != 1 or text.count(cls._OUT) != 1 or text.index(cls._OUT) < text.index(cls._MARK):
            raise ValueError("the chat template does not render a tool message after the assistant's turn")
        after = text[text.index(cls._MARK) + len(cls._MARK) :]
        head, tail = after.split(cls._OUT)
        return head, tail

    def text(self, output: str) -> str:
        return self.head + output + self.tail


@dataclass
class _Trajectory:
    prompt: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    stats: TurnStats = field(default_factory=TurnStats)
    finish: str = ""  # set when done: "stop" | "length"
    call: tuple[str, dict] | str | None = None  # the call waiting for its tool
    tools: tuple[str, ...] | None = None  # what its prompt may call (None: every enabled tool)

    def add(self, tokens: Sequence[int], policy: bool, logprobs: Sequence[float] | None = None) -> None:
        self.tokens += tokens
        self.mask += [policy] * len(tokens)
        if policy and self.logprobs is not None:
            self.logprobs = None if logprobs is None else self.logprobs + list(logprobs[: len(tokens)])


class MultiTurnEngine(ShardedSteps):
    """A :class:`~pacs_megatron.rollout.base.RolloutEngine`: the turn loop over an engine (module docstring);
    its traits, weights, probe and memory are the wrapped engine's, its steps are sharded over the turn loop."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        cfg: MultiTurnConfig,
        tools: ToolPool,
        use_template: bool,
        access: Mapping[tuple[int, ...], tuple[str, ...]] | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.cfg, self.tools = engine, tokenizer, cfg, tools
        # the tools of the prompts whose rows name their own (tool_access), by prompt token ids: the ids are
        # what every caller hands ``generate`` (training, validation, the engine processes), records are not
        self.access = dict(access or {})
        self.format = HermesFormat()
        self.turn = ToolTurn(tokenizer, use_template)

    def traits(self) -> EngineTraits:
        return self.engine.traits()

    def update_weights(self, buckets: Iterable[NamedTensors]) -> int:
        return self.engine.update_weights(buckets)

    def logprobs(self, token_ids: Sequence[Sequence[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        return self.engine.logprobs(token_ids, temperature)

    def weight_checksums(self) -> list[Held] | None:
        """The wrapped engine's (None when it cannot be read back)."""
        return self.engine.weight_checksums() if isinstance(self.engine, ChecksumReader) else None

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def close(self) -> None:
        """The engine's close, then the tool pool's (its threads or Ray tasks); idempotent as both are."""
        try:
            self.engine.close()
        finally:
            self.tools.close()

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[list[Response]]:
        """``sampling.n`` trajectories per prompt, in prompt order; ``sampling.max_tokens`` bounds each whole
        trajectory (policy and tool tokens)."""
        budget, stop = sampling.max_tokens, (*sampling.stop, self.format.close)
        trajs = [
            _Trajectory(tuple(p), tools=self.access.get(tuple(p))) for p in prompt_token_ids for _ in range(sampling.n)
        ]
        for turn in range(self.cfg.max_turns):
            active = [t for t in trajs if not t.finish]
            if not active:
                break
            start = time.perf_counter()
            if turn == 0:  # one request per prompt: its n samples share the prompt's prefill
                groups = self.engine.generate(prompt_token_ids, replace(sampling, stop=stop))
                outs = [r for g in groups for r in g]
            else:  # each its own context; the round's seed moves on, so a resumed run draws the same
                seed = None if sampling.seed is None else sampling.seed + 7_919 * turn
                room = max(budget - len(t.tokens) for t in active)
                contexts = [t.prompt + tuple(t.tokens) for t in active]
                call = replace(sampling, n=1, seed=seed, max_tokens=room, stop=stop)
                outs = [g[0] for g in self.engine.generate(contexts, call)]
            seconds = time.perf_counter() - start
            for t, out in zip(active, outs):
                t.stats.generate_seconds += seconds
                if turn:  # the prefix cache's share of the re-sent context (a grown context re-prefills the rest)
                    t.stats.resent_tokens += len(t.prompt) + len(t.tokens)
                    if out.cached_tokens is not None:
                        t.stats.cached_tokens = (t.stats.cached_tokens or 0) + out.cached_tokens
                self._take_turn(t, out, budget, stop, last=turn == self.cfg.max_turns - 1)
            self._run_tools([t for t in active if t.call is not None], budget)
        return [
            [self._response(t) for t in trajs[i * sampling.n : (i + 1) * sampling.n]]
            for i in range(len(prompt_token_ids))
        ]

    def _take_turn(self, t: _Trajectory, out: Response, budget: int, stop: Sequence[str], last: bool) -> None:
        """Append one generated turn; decide whether the trajectory ends or calls a tool."""
        tokens = list(out.token_ids)
        cut = stop_string_cut(tokens, stop, self._decode)  # the rule; engines stop on strings to save work
        tokens = tokens[:cut] if cut is not None else tokens
        text = self._decode(tokens)
        closed = cut is not None and self.format.close in text
        room = budget - len(t.tokens)
        t.stats.turns += 1
        t.add(tokens[:room], True, out.logprobs)
        if len(tokens) > room or (out.truncated and cut is None) or (closed and len(t.tokens) >= budget):
            t.finish = "length"
        elif not closed or last:  # EOS (or a user stop string), or no turn left to read a tool's answer
            t.finish = "stop"
        else:
            t.call = self.format.parse(text)

    def _run_tools(self, waiting: list[_Trajectory], budget: int) -> None:
        """Run the round's parsed calls together; answer malformed ones, and calls of a tool the prompt may not
        use, with their error."""
        for t in waiting:
            if isinstance(t.call, tuple) and t.tools is not None and t.call[0] not in t.tools:
                t.call = f"Error: no tool {t.call[0]!r} here; this problem's tools are {list(t.tools)}"
        calls = [t.call for t in waiting if isinstance(t.call, tuple)]
        results = iter(self.tools.run(calls) if calls else [])
        for t in waiting:
            if isinstance(t.call, tuple):
                r = next(results)
                text, ok, seconds = r.text, r.ok, r.seconds
                t.stats.tool_timeouts += r.kind == "timeout"
            else:
                text, ok, seconds = str(t.call), False, 0.0
            t.call = None
            t.stats.tool_calls += 1
            t.stats.tool_errors += not ok
            t.stats.tool_seconds += seconds
            self._add_tool_turn(t, text, budget)

    def _add_tool_turn(self, t: _Trajectory, output: str, budget: int) -> None:
        ids = self.tokenizer.encode(output, add_special_tokens=False)
        if len(ids) > self.cfg.max_tool_output_tokens:  # cut before it can crowd the context out
            keep = self.cfg.max_tool_output_tokens
            output = self.tokenizer.decode(ids[:keep]) + f"\n... [{len(ids) - keep} more tokens cut]"
        ids = self.tokenizer.encode(self.turn.text(output), add_special_tokens=False)
        t.add(ids[: budget - len(t.tokens)], False)
        if len(t.tokens) >= budget:  # no room left for the policy to read the answer
            t.finish = "length"

    def _response(self, t: _Trajectory) -> Response:
        policy = [tok for tok, m in zip(t.tokens, t.mask) if m]
        t.stats.transcript = self.tokenizer.decode(t.tokens, skip_special_tokens=True)
        return Response(
            token_ids=tuple(t.tokens),
            # the verifier reads the policy's own words: an answer a tool printed is not the model's answer
            text=self.tokenizer.decode(policy, skip_special_tokens=True),
            finish_reason=t.finish or "stop",
            logprobs=None if t.logprobs is None else tuple(t.logprobs),
            policy_mask=tuple(t.mask),
            turns=t.stats,
        )


def demo_code(record: PromptRecord) -> str:
    """The code a demonstration calls for a problem: the expression of the arithmetic task's problems (their
    ids are ``arith-A+B``); other tasks have no demonstrations (ValueError naming the problem)."""
    if record.source == "arith" and record.id.startswith("arith-"):
        a, b = record.id.removeprefix("arith-").split("+")
        return f"print({a} + {b})"
    raise ValueError(f"no tool demonstration for problem {record.id!r} (source {record.source}): only data.task=arith")


def tool_demonstration(engine: MultiTurnEngine, record: PromptRecord) -> tuple[list[int], list[int], list[bool]]:
    """``(prompt ids, response ids, policy mask)`` of one demonstration: the call of :func:`demo_code`, the tool
    turn with what the sandbox really printed, and the answer copied from it in the task's format (``\boxed``)."""
    call = f"{engine.format.open}{json.dumps({'name': 'python', 'arguments': {'code': demo_code(record)}})}"
    call += engine.format.close
    [result] = engine.tools.run([("python", {"code": demo_code(record)})])
    if not result.ok:
        raise RuntimeError(f"the tool failed on the demonstration of {record.id}: {result.kind}: {result.text}")
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    policy, tool = encode(call), encode(engine.turn.text(result.text.strip()))
    answer = encode(f"The answer is \\boxed{{{result.text.strip()}}}.") + [engine.tokenizer.eos_token_id]
    mask = [True] * len(policy) + [False] * len(tool) + [True] * len(answer)
    return list(record.prompt_ids), policy + tool + answer, mask


def turn_metrics(responses: Sequence[Response]) -> dict[str, float]:
    """Per-step means of the trajectories' counters (empty for single-turn rollouts)."""
    stats = [r.turns for r in responses if r.turns is not None]
    if not stats:
        return {}
    k = len(stats)
    calls = sum(s.tool_calls for s in stats)
    tool_tokens = sum(len(r.token_ids) - r.policy_tokens for r in responses)
    known = [s for s in stats if s.cached_tokens is not None and s.resent_tokens]
    hits = sum(s.cached_tokens or 0 for s in known) / max(sum(s.resent_tokens for s in known), 1)
    cache = {"tools/prefix_cache_hit_rate": hits}
    return {
        **(cache if known else {}),
        "tools/turns_mean": sum(s.turns for s in stats) / k,
        "tools/calls_mean": calls / k,
        "tools/call_rate": sum(s.tool_calls > 0 for s in stats) / k,
        "tools/error_rate": sum(s.tool_errors for s in stats) / max(calls, 1),
        "tools/timeout_rate": sum(s.tool_timeouts for s in stats) / max(calls, 1),
        "tools/seconds_mean": sum(s.tool_seconds for s in stats) / k,
        "tools/generate_seconds_mean": sum(s.generate_seconds for s in stats) / k,
        "tools/output_tokens_mean": tool_tokens / k,
    }


def tool_access(records: Iterable[PromptRecord]) -> dict[tuple[int, ...], tuple[str, ...]]:
    """The tools of each prompt whose row names its own (``PromptRecord.tools``), keyed by its token ids; a
    prompt shared by rows naming different tools raises in one line (its text cannot tell the policy which)."""
    access: dict[tuple[int, ...], tuple[str, ...]] = {}
    owner: dict[tuple[int, ...], str] = {}
    for rec in records:
        if rec.tools is None:
            continue
        key = tuple(rec.prompt_ids)
        if access.setdefault(key, rec.tools) != rec.tools:
            raise ValueError(
                f"problems {owner[key]!r} and {rec.source}/{rec.id!r} have the same prompt but different tools "
                f"({list(access[key])} vs {list(rec.tools)}): name the tools in the prompt's text, or give both "
                "rows one list"
            )
        owner.setdefault(key, f"{rec.source}/{rec.id}")
    return access


def uses_chat_template(data: DataConfig) -> bool:
    """Whether the run's prompts (``data``) are rendered by a chat template (then tool turns are too)."""
    return data.renders_prompts and data.chat_template != "none"


def with_tools(
    engine: Any,
    multi_turn: MultiTurnConfig,
    tools: ToolsConfig,
    chat_template: bool,
    tokenizer: Any,
    records: Iterable[PromptRecord] = (),
) -> Any:
    """``engine`` itself for single-turn rollouts; with ``multi_turn`` (``rollout.multi_turn``) enabled the turn
    loop over it, with the tool pool ``tools`` describes (its sandbox checked first: envs/pool.py), tool turns
    rendered by the chat template when ``chat_template`` (:func:`uses_chat_template`), and the tools each of
    ``records`` (the run's prompts) may call."""
    if not multi_turn.enabled:
        return engine
    from pacs_megatron.envs.pool import make_pool

    access = tool_access(records)
    pool = make_pool(tools)
    return MultiTurnEngine(engine, tokenizer, multi_turn, pool, chat_template, access)
