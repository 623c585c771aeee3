"""The library entry of evaluation with a scripted engine: known metrics and rows."""

import pytest

from pacs_megatron.config import ArithTaskConfig, RewardConfig
from pacs_megatron.data.synthetic import arith_problems, arith_records, build_arith_tokenizer
from pacs_megatron.eval.runner import evaluate
from pacs_megatron.reward import RewardScorer
from pacs_megatron.rollout.base import EngineTraits
from pacs_megatron.rollout.collect import ShardedSteps
from pacs_megatron.rollout.types import Response, SamplingParams
from pacs_megatron.utils.dist import rank_and_world


class ScriptedEngine(ShardedSteps):
    """Answers each prompt with scripted texts (one per sample), whatever the sampling; a replica per rank."""

    def traits(self) -> EngineTraits:
        return EngineTraits(*rank_and_world())

    def __init__(self, tok, script: dict[str, list[str]], turns=None):
        self.tok, self.script, self.calls, self.turns = tok, script, [], turns or {}

    def generate(self, prompt_token_ids, sampling):
        self.calls.append(sampling)
        out = []
        for ids in prompt_token_ids:
            prompt = self.tok.decode(list(ids))
            texts = self.script[prompt][: sampling.n]
            turns = self.turns.get(prompt)  # a multi-turn engine's counters (rollout/multi_turn.py)
            out.append([Response(tuple(self.tok(t)["input_ids"]), t, "stop", turns=turns) for t in texts])
        return out


@pytest.mark.subprocess
@pytest.mark.parametrize("sharded", [False, True])
def test_evaluate_metrics_and_rows(sharded):
    tok = build_arith_tokenizer()
    recs = arith_records(arith_problems(ArithTaskConfig(max_operand=1, modulo=0)), tok)  # 0+0 0+1 1+0 1+1
    script = {"0+0=": ["0", "0"], "0+1=": ["1", "2"], "1+0=": ["2", "3"], "1+1=": ["2", "0"]}
    engine = ScriptedEngine(tok, script)
    sampling = SamplingParams(n=2, max_tokens=2, seed=3)
    with RewardScorer(RewardConfig(fn="arith", num_workers=0)) as scorer:
        metrics, rows = evaluate(engine, {"x": recs[:2], "y": recs[2:]}, sampling, [1, 2], scorer, sharded=sharded)
    # x: [1,1] and [1,0] -> pass@1 (1 + .5)/2, pass@2 1; y: [0,0] and [1,0] -> pass@1 .25, pass@2 .5
    assert metrics["val/x/pass@1"] == pytest.approx(0.75) and metrics["val/x/pass@2"] == pytest.approx(1.0)
    assert metrics["val/y/pass@1"] == pytest.approx(0.25) and metrics["val/y/pass@2"] == pytest.approx(0.5)
    assert metrics["val/overall/pass@1"] == pytest.approx(0.5)
    assert metrics["val/reward_errors"] == 0 and metrics["val/reward_timeouts"] == 0
    assert [r["id"] for r in rows] == ["arith-0+0", "arith-0+1", "arith-1+0", "arith-1+1"]
    assert rows[1]["responses"] == ["1", "2"] and rows[1]["scores"] == [1.0, 0.0] and rows[1]["dataset"] == "x"
    assert rows[3]["prompt"] == "1+1=" and rows[3]["answer"] == "2"
    assert len(engine.calls) == 1  # all datasets in one generate call
    with pytest.raises(ValueError, match="k=\\[4\\]"):
        evaluate(engine, {"x": recs}, sampling, [4], scorer)


@pytest.mark.subprocess
def test_validation_reports_each_sets_tool_use():
    from pacs_megatron.rollout.multi_turn import TurnStats

    tok = build_arith_tokenizer()
    recs = arith_records(arith_problems(ArithTaskConfig(max_operand=1, modulo=0)), tok)
    script = {"0+0=": ["0"], "0+1=": ["1"], "1+0=": ["1"], "1+1=": ["2"]}
    called = TurnStats(turns=2, tool_calls=1, tool_timeouts=1, tool_errors=1, transcript="call 1+1 -> 2")
    engine = ScriptedEngine(tok, script, turns={"1+1=": called, "1+0=": TurnStats(turns=1)})
    with RewardScorer(RewardConfig(fn="arith", num_workers=0)) as scorer:
        metrics, rows = evaluate(engine, {"x": recs[:2], "y": recs[2:]}, SamplingParams(n=1), [1], scorer)
    assert metrics["val/y/tools/call_rate"] == 0.5 and metrics["val/y/tools/timeout_rate"] == 1
    assert metrics["val/y/tools/turns_mean"] == 1.5 and not any("/tools/" in k for k in metrics if "/x/" in k)
    assert rows[3]["transcripts"] == ["call 1+1 -> 2"] and "transcripts" not in rows[0]


@pytest.mark.subprocess
def test_a_long_validation_shows_progress_and_one_result_line_per_set(monkeypatch, capsys):
    """Fails on the old code: the training loop's (sharded) validation printed nothing until the run's summary."""
    import pacs_megatron.eval.runner as runner
    from pacs_megatron.utils.logging import init_logging

    monkeypatch.setattr(runner, "QUIET_S", 0.0)  # a real validation stays quiet for its first 10 s
    monkeypatch.setattr(runner, "MIN_CHUNK_SAMPLES", 1)
    init_logging()
    tok = build_arith_tokenizer()
    recs = arith_records(arith_problems(ArithTaskConfig(max_operand=4, modulo=0)), tok)  # 25 problems
    script = {r.prompt_text: [r.answer, "9"] for r in recs}  # one right, one wrong answer each
    engine = ScriptedEngine(tok, script)
    with RewardScorer(RewardConfig(fn="arith", num_workers=0)) as scorer:
        metrics, _ = evaluate(
            engine, {"a": recs[:20], "b": recs[20:]}, SamplingParams(n=2, seed=1), [1, 2], scorer, sharded=True, step=7
        )
    err = capsys.readouterr().err
    progress = [ln for ln in err.splitlines() if "samples (" in ln]
    assert len(engine.calls) == 9 and len(progress) >= 5  # ceil(25 / 10) = 3 problems per call
    assert "validation (step 7): 6/50 samples (12%)" in progress[0] and "ETA" in progress[0]
    assert "validation (step 7): 50/50 samples (100%)" in progress[-1]
    assert len({s.seed for s in engine.calls}) == 9  # chunk j samples with its own seed (seed + j, then per replica)
    assert "validation (step 7): a: pass@1=0.500 pass@2=1.000" in err and "(20 problems x 2)" in err
    assert "validation (step 7): b: pass@1=0.500" in err and "overall: pass@1=0.500" in err
    assert metrics["val/a/pass@1"] == pytest.approx(0.5)
