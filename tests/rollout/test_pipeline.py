"""The rollout pipeline of rollout.max_staleness (rollout/pipeline.py, issue 31 items 2 and 5), against an
in-process fake of the engines that serves commands in order as the real ones do (a generation is sampled
with the last weights queued before it). The real processes are tests/rollout/remote/test_remote_engines.py.

(a) the schedule: step s is sampled with version max(s0, s-1-k), so staleness is exactly min(k, s-1-s0) and
    never above k; at k = 0 each step is submitted only after the previous step's weights (synchronous);
(b) an engine that missed a load: its groups are dropped, counted and regenerated, and still-stale ones raise;
(c) in-flight prompts: the saved sampler state is the first untrained step's, and a resumed stream draws the
    in-flight prompts again in order: no prompt lost or trained twice.
"""

from __future__ import annotations

import pytest

from pacs_megatron.data.records import PromptRecord
from pacs_megatron.data.sampler import PromptDataset
from pacs_megatron.rollout.pipeline import InFlightPrompts, RolloutPipeline
from pacs_megatron.rollout.types import Response, SamplingParams

N = 2


class FakeEngines:
    """Commands in order: a generation takes the version of the last weights queued before it."""

    def __init__(self, lag: int = 0) -> None:
        self.version = 0
        self.lag = lag  # versions an engine "missed" on the first generation of each step
        self.queued: dict = {}
        self.log: list = []

    def push(self, version: int) -> None:
        self.version = version
        self.log.append(("load", version))

    def submit(self, tag, prompt_ids, sampling, step) -> None:
        lag = self.lag if tag[0] == "step" else 0
        self.queued[tag] = (prompt_ids, self.version - lag)
        self.log.append(("generate", tag, self.version - lag))

    def collect(self, tag):
        prompts, version = self.queued.pop(tag)
        groups = [[Response((p[0], j), "", "stop") for j in range(N)] for p in prompts]
        return groups, [version] * len(groups), 0.01, ([0.1], [0.0])


def _stream(num: int = 7) -> InFlightPrompts:
    return InFlightPrompts(PromptDataset([PromptRecord(str(i), "", "", (i,), "", "t") for i in range(num)], seed=3))


def _run(k: int, start: int, last: int, engines: FakeEngines, prompts: InFlightPrompts, stop_after: int = 0):
    """The asynchronous loop's calls, in its order; returns per step (prompt ids, staleness max, metrics)."""
    pipe = RolloutPipeline(engines, prompts, 3, SamplingParams(n=N), k, last)
    pipe.start(start)
    out = {}
    for step in range(start + 1, last + 1):
        taken = pipe.take(step)
        assert [g[0].token_ids[0] for g in taken.groups] == [r.prompt_ids[0] for r in taken.records]
        assert len(taken.versions) == len(taken.groups) and max(taken.versions) <= step - 1
        out[step] = ([r.id for r in taken.records], taken.metrics)
        engines.push(step)  # train, then the weights of version `step`
        pipe.pushed(step)
        if step == stop_after:
            break
    return out, pipe


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("start", [0, 4])
def test_staleness_is_exactly_min_k_and_never_above_k(k, start):
    engines = FakeEngines()
    engines.version = start
    out, pipe = _run(k, start, start + 9, engines, _stream())
    for step, (_, m) in out.items():
        assert m["async/staleness_max"] == m["async/staleness_mean"] == min(k, step - 1 - start) <= k
        assert m["async/dropped_samples"] == 0.0
        assert m[f"async/staleness_frac_{min(k, step - 1 - start)}"] == 1.0
    assert not pipe.in_flight  # nothing submitted past the last step
    gens = [e for e in engines.log if e[0] == "generate"]
    assert [g[1][1] for g in gens] == list(range(start + 1, start + 10))  # each step once, in order
    if k == 0:  # synchronous: step s is queued right after the weights of s - 1, and sampled with them
        assert [e[0] for e in engines.log] == ["generate", "load"] * 9
        assert [g[2] for g in gens] == list(range(start, start + 9))


def test_a_stale_engine_is_dropped_counted_and_regenerated():
    engines = FakeEngines(lag=2)  # every step's first generation uses weights 2 versions too old
    out, pipe = _run(1, 0, 5, engines, _stream())
    for step in range(1, 6):
        m = out[step][1]
        assert m["async/dropped_samples"] == 3 * N and m["async/staleness_max"] <= 1
    assert out[5][1]["async/dropped_total"] == pipe.dropped_total > 0
    regen = [e for e in engines.log if e[0] == "generate" and e[1][0] == "regenerate"]
    assert [e[1][1] for e in regen] == [1, 2, 3, 4, 5]


def test_still_stale_after_regeneration_raises():
    engines = FakeEngines()
    engines.collect = lambda tag, real=engines.collect: (lambda g, v, w, t: (g, [x - 5 for x in v], w, t))(*real(tag))
    with pytest.raises(RuntimeError, match=r"still sample with version -5 < 0 .*missed a weight load"):
        _run(0, 0, 3, engines, _stream())


@pytest.mark.parametrize("k", [1, 2])
def test_a_resumed_stream_draws_the_in_flight_prompts_again(k):
    full, _ = _run(k, 0, 8, FakeEngines(), _stream())
    prompts = _stream()
    partial, _ = _run(k, 0, 8, FakeEngines(), prompts, stop_after=3)  # "checkpoint" after step 3
    state = prompts.state_dict()
    assert state["in_flight"]["batches"] == k + 1 and state["in_flight"]["prompts"] == 3 * (k + 1)  # 4 .. 4+k
    assert "draws these prompts again" in state["in_flight"]["on_resume"]
    resumed = _stream()
    resumed.load_state_dict(state)
    engines = FakeEngines()
    engines.version = 3
    rest, _ = _run(k, 3, 8, engines, resumed)
    ids = [partial[s][0] for s in range(1, 4)] + [rest[s][0] for s in range(4, 9)]
    assert ids == [full[s][0] for s in range(1, 9)]
    assert rest[4][1]["async/staleness_max"] == 0  # regenerated with the checkpoint's weights
