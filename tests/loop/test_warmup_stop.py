"""The tool warm-up's stopping rule (issue 58, item 2): a fixed count, or until the policy's calls parse and run on
held-out prompts, checked through the turn loop's own parser over a scripted engine whose calls become valid after
a number of supervised steps."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
from _ascii import ascii_tokenizer

from pacs_megatron.config import load_config
from pacs_megatron.config.multi_turn import MultiTurnConfig
from pacs_megatron.data.records import PromptRecord
from pacs_megatron.envs.result import ToolResult
from pacs_megatron.loop import warmup
from pacs_megatron.loop.warmup import StopRule, run_until_valid, stop_record, tool_warmup, valid_call_metrics
from pacs_megatron.rollout.multi_turn import MultiTurnEngine, TurnStats
from pacs_megatron.rollout.types import Response
from pacs_megatron.utils.dist import rank_and_world

TOK = ascii_tokenizer()
VALID = '<tool_call>{"name": "python", "arguments": {"code": "print(2 + 3)"}}</tool_call>'
BROKEN = '<tool_call>{"name": "python", "arguments": </tool_call>'
TOOLS = ["rollout.multi_turn.max_turns=3", "tools.enabled=[python]", "trainer.sft_warmup_steps=12"]


@pytest.fixture
def log(caplog):
    """The warm-up's records (the package logger stops propagating once a run in this process configured it)."""
    package = logging.getLogger("pacs_megatron")
    propagate, package.propagate = package.propagate, True
    caplog.set_level(logging.INFO, logger=warmup.__name__)
    yield caplog
    package.propagate = propagate


class _Pool:
    """The sandbox's stand-in: prints the sum a ``print(a + b)`` call asks for."""

    def run(self, calls):
        return [ToolResult(str(eval(args["code"][6:-1])), "ok", 0.1, name) for name, args in calls]

    def close(self):
        pass


class _Actor:
    def __init__(self) -> None:
        self.steps = 0

    def train_step(self, batch, loss_name=None):
        self.steps += 1
        return {"sft/loss": 1.0 / self.steps}


class _Engine:
    """Writes a broken call until the actor has trained ``skilled_after`` steps, a valid one after; answers
    once the tool turn is in its context. Records the prompts of each first round, and syncs and sleeps."""

    def __init__(self, actor: _Actor, skilled_after: int) -> None:
        self.actor, self.skilled_after = actor, skilled_after
        self.asked: list[str] = []
        self.synced = self.slept = 0

    def generate(self, prompts, sampling):
        out = []
        for p in prompts:
            text = TOK.decode(list(p))
            if "<|im_start|>tool" in text:
                reply = "The answer is \\boxed{5}."
            else:
                self.asked.append(text)
                reply = VALID if self.actor.steps >= self.skilled_after else BROKEN
            ids = (*TOK.encode(reply, add_special_tokens=False), TOK.eos_token_id)
            out.append([Response(ids, reply, "stop", None)] * sampling.n)
        return out

    def sleep(self):
        self.slept += 1

    def traits(self):
        """One replica per rank, as an HF engine is."""
        rank, world = rank_and_world()
        return SimpleNamespace(replica=rank, replicas=world)


def _records(n: int) -> list[PromptRecord]:
    out = []
    for a in range(n):
        text = TOK.apply_chat_template(
            [{"role": "user", "content": f"{a}+3?"}], tokenize=False, add_generation_prompt=True
        )
        ids = tuple(TOK.encode(text, add_special_tokens=False))
        out.append(PromptRecord(f"arith-{a}+3", f"{a}+3?", text, ids, str(a + 3), "arith"))
    return out


def _components(skilled_after: int, records: int = 30):
    actor = _Actor()
    inner = _Engine(actor, skilled_after)
    engine = MultiTurnEngine(inner, TOK, MultiTurnConfig(max_turns=3), _Pool(), use_template=True)
    sync = SimpleNamespace(sync=lambda version=0: setattr(inner, "synced", inner.synced + 1))
    c = SimpleNamespace(
        actor=actor,
        engine=engine,
        dataset=SimpleNamespace(records=_records(records)),
        pad_id=TOK.pad_token_id,
        sync=sync,
    )
    rt = SimpleNamespace(groups=SimpleNamespace(dp_rank=0, dp_size=1))
    return c, rt, inner


def _stats(calls: int, errors: int) -> Response:
    return Response((1,), "", "stop", None, turns=TurnStats(tool_calls=calls, tool_errors=errors))


def test_valid_call_rate_counts_samples_whose_every_call_ran():
    # no call (fails), one call that ran, one ran + one failed (fails), two that ran
    m = valid_call_metrics([_stats(0, 0), _stats(1, 0), _stats(2, 1), _stats(2, 0)])
    assert m == {"sft/valid_call_rate": 0.5, "sft/call_rate": 0.75, "sft/call_error_rate": 0.2}
    with pytest.raises(ValueError, match="multi_turn.max_turns"):
        valid_call_metrics([Response((1,), "", "stop", None)])


def test_checks_fall_every_check_every_steps_and_on_the_last():
    rule = StopRule(threshold=0.8, check_every=3, max_steps=10)
    assert [s for s in range(1, 11) if rule.due(s)] == [3, 6, 9, 10]
    assert rule.verdict(3, 0.8) == "threshold" and rule.verdict(9, 0.79) is None and rule.verdict(10, 0.5) == "max"


def test_stops_at_the_first_check_over_the_threshold(log):
    rates = {2: 0.1, 4: 0.5, 6: 0.85, 8: 1.0}
    steps, checked = [], []
    out = run_until_valid(
        StopRule(0.8, 2, 20),
        lambda: steps.append(1) or {"sft/loss": 0.5},
        lambda s: checked.append(s) or {"sft/valid_call_rate": rates[s]},
    )
    assert len(steps) == 6 and checked == [2, 4, 6]
    assert out["sft/warmup_steps"] == 6 and out["sft/warmup_reached"] == 1 and out["sft/loss"] == 0.5
    lines = [r.getMessage() for r in log.records]
    assert sum("tool warm-up check at step" in x for x in lines) == 3
    [stop] = [x for x in lines if "stopped" in x]
    assert (
        "step 6 of at most 20: threshold reached, valid-call rate 0.850 >= trainer.sft_warmup_stop.threshold=0.8"
        in stop
    )
    assert not [r for r in log.records if r.levelno >= logging.WARNING]


def test_max_steps_below_the_threshold_trains_on_and_warns_once(log):
    checked = []
    out = run_until_valid(
        StopRule(0.8, 2, 5), lambda: {"sft/loss": 0.5}, lambda s: checked.append(s) or {"sft/valid_call_rate": 0.3}
    )
    assert checked == [2, 4, 5] and out["sft/warmup_steps"] == 5 and out["sft/warmup_reached"] == 0
    [warning] = [r.getMessage() for r in log.records if r.levelno >= logging.WARNING]
    assert "stopped at step 5: max steps reached" in warning and "valid-call rate 0.300 < " in warning
    assert "raise trainer.sft_warmup_steps" in warning


def test_valid_calls_mode_stops_on_held_out_prompts_through_the_turn_loop(log):
    cfg = load_config(
        None, [*TOOLS, "trainer.sft_warmup_stop.until=valid_calls", "trainer.sft_warmup_stop.check_every=2"]
    )
    c, rt, inner = _components(skilled_after=5)
    out = tool_warmup(cfg, rt, c)
    # broken calls at the checks after steps 2 and 4, valid ones after step 6
    assert c.actor.steps == 6 and out["sft/warmup_steps"] == 6 and out["sft/valid_call_rate"] == 1.0
    assert inner.synced == inner.slept == 3  # each check samples the weights just trained, then frees the engine
    held = set(inner.asked)
    assert (
        len(held) == cfg.trainer.sft_warmup_stop.held_out and len(inner.asked) == 3 * 8
    )  # 8 prompts a check (4 samples each)
    demos = {r.prompt_text for r in random.Random(cfg.trainer.seed).sample(c.dataset.records, 8)}
    assert not held & demos  # the check never samples a demonstration's prompt
    assert stop_record(out) == {k: out[k] for k in warmup.STOP_KEYS}
    assert any("threshold reached" in r.getMessage() for r in log.records)


def test_valid_calls_mode_below_threshold_at_max_warns(log):
    cfg = load_config(None, [*TOOLS, "trainer.sft_warmup_stop.until=valid_calls", "trainer.sft_warmup_steps=3"])
    c, rt, _ = _components(skilled_after=100)
    out = tool_warmup(cfg, rt, c)
    assert c.actor.steps == 3 and out["sft/valid_call_rate"] == 0.0 and out["sft/call_error_rate"] == 1.0
    assert out["sft/warmup_reached"] == 0
    assert sum(r.levelno >= logging.WARNING for r in log.records) == 1


def test_fixed_mode_trains_exactly_its_steps_and_never_samples():
    cfg = load_config(None, TOOLS)
    assert cfg.trainer.sft_warmup_stop.until == "steps"  # the default: a fixed warm-up reproduces exactly
    c, rt, inner = _components(skilled_after=0)
    out = tool_warmup(cfg, rt, c)
    assert c.actor.steps == 12 and out == {"sft/loss": 1.0 / 12}
    assert inner.asked == [] and inner.synced == inner.slept == 0 and stop_record(out) == {}


def test_a_held_out_set_larger_than_the_train_set_is_refused():
    cfg = load_config(None, [*TOOLS, "trainer.sft_warmup_stop.until=valid_calls", "trainer.sft_warmup_stop.held_out=8"])
    c, rt, _ = _components(skilled_after=0, records=12)
    with pytest.raises(ValueError, match=r"held_out=8: the train set has 4 problems besides the 8 demonstrations"):
        tool_warmup(cfg, rt, c)


def _warm_up_on_rank(rank: int, world_size: int) -> dict:
    cfg = load_config(None, [*TOOLS, "trainer.sft_warmup_stop.until=valid_calls", "parallel.dp=2"])
    c, rt, _ = _components(skilled_after=4 if rank == 0 else 2)  # each rank's engine learns at its own pace
    rt.groups.dp_rank, rt.groups.dp_size = rank, world_size
    return tool_warmup(cfg, rt, c)


@pytest.mark.distributed
def test_every_dp_rank_stops_at_the_same_step():
    from _dist import run_distributed

    # each engine samples its half of the held-out prompts: rank 1's calls run from step 2, rank 0's from step 4;
    # alone, rank 1 would stop at step 2 (its half) and rank 0 at step 4, and the ranks' collectives would part
    results = run_distributed(_warm_up_on_rank, 2)
    assert results[0] == results[1]
    assert results[0]["sft/warmup_steps"] == 4 and results[0]["sft/valid_call_rate"] == 1.0
