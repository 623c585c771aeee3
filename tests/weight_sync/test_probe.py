"""WeightSync's push accounting and probe tolerance, on a fake actor and a fake engine. The probe's rows are
PROBE_LEN // 2 random prompt tokens (positions 1..HALF-1 of the engine's log-probs, bounded relative to
|logp|) and the engine's greedy continuation (positions HALF.., bounded in the mean, absolutely)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pacs_megatron.config import SyncConfig
from pacs_megatron.rollout.base import PROBE_LEN, EngineTraits
from pacs_megatron.rollout.types import Response
from pacs_megatron.weight_sync import SyncResult, WeightSync, WeightSyncError, probe_prompts

VOCAB = 50
HALF = PROBE_LEN // 2


class FakeActor:
    """Exports fixed tensors; its log-probs of token t are -scale * (1 + t % 7) (position 0 holds 0)."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale
        self.tensors = [("a", torch.ones(256)), ("b", torch.ones(256, 2)), ("ids", torch.arange(4))]

    def export_hf_weights(self):
        yield from self.tensors

    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        lp = -self.scale * (1.0 + (ids % 7).double())
        lp[..., 0] = 0.0
        return lp

    def compute_logprobs(self, batch, micro_batch_size, temperature):
        assert temperature == 1.0 and micro_batch_size == len(batch)
        return SimpleNamespace(token_logp=self.reference(batch.input_ids).float())


class FakeEngine:
    """Receives buckets; returns the actor's log-probs plus ``error(position)`` at every token."""

    def __init__(self, actor: FakeActor, error=lambda t: 0.0, in_place: bool = False):
        self.actor, self.error, self.in_place = actor, error, in_place
        self.received: list[list[tuple[str, torch.Tensor]]] = []

    def traits(self) -> EngineTraits:
        return EngineTraits(loads_in_place=self.in_place)

    def update_weights(self, buckets):
        self.received = [list(b) for b in buckets]
        return sum(len(b) for b in self.received)

    def generate(self, prompts, sampling):
        assert sampling.top_k == 1 and sampling.n == 1  # greedy
        return [[Response(tuple(range(1, sampling.max_tokens + 1)), "", "length")] for _ in prompts]

    def logprobs(self, token_ids, temperature=1.0):
        out = []
        for seq in token_ids:
            ref = self.actor.reference(torch.tensor(seq))[1:]
            out.append(torch.tensor([r + self.error(t) for t, r in enumerate(ref.tolist(), 1)], dtype=torch.float64))
        return out


def _sync(actor, engine, param_dtype=torch.float32, **cfg):
    return WeightSync(actor, engine, SyncConfig(**cfg), VOCAB, param_dtype)


def test_push_counts_buckets_and_bytes_and_casts():
    actor = FakeActor()
    engine = FakeEngine(actor)
    res = _sync(actor, engine, bucket_mb=1, dtype="bfloat16").push()
    assert res.buckets == 1 and math.isnan(res.max_logprob_diff) and res.seconds > 0
    assert res.gbytes == pytest.approx((256 * 2 + 512 * 2 + 4 * 8) / 1e9)
    dtypes = {n: t.dtype for b in engine.received for n, t in b}
    assert dtypes == {"a": torch.bfloat16, "b": torch.bfloat16, "ids": torch.int64}
    m = SyncResult(
        seconds=2.0,
        gbytes=1.0,
        max_logprob_diff=0.5,
        buckets=3,
        quant_logprob_diff=0.7,
        greedy_logprob_diff=0.1,
        bitwise_seconds=0.3,
        bitwise_tensors=5,
    ).metrics()
    assert m == {
        "sync/seconds": 2.0,
        "sync/gbytes": 1.0,
        "sync/gbytes_per_s": 0.5,
        "sync/max_logprob_diff": 0.5,
        "sync/buckets": 3.0,
        "sync/quant_logprob_diff": 0.7,
        "sync/greedy_logprob_diff": 0.1,
        "sync/bitwise_seconds": 0.3,
        "sync/bitwise_tensors": 5.0,
    }


def test_engine_that_loads_in_place_gets_the_stream_tensor_by_tensor_uncast():
    actor = FakeActor()
    streaming = FakeEngine(actor, in_place=True)
    sync = _sync(actor, streaming, bucket_mb=1, dtype="bfloat16")
    res = sync.push()
    assert res.buckets == 3 and [len(b) for b in streaming.received] == [1, 1, 1]
    assert {t.dtype for b in streaming.received for _, t in b} == {torch.float32, torch.int64}  # it casts itself
    assert res.gbytes == pytest.approx((1024 + 2048 + 32) / 1e9)
    assert sync.tolerance == 5e-2  # the probe still judges the dtype the engine holds


def test_exact_engine_passes_with_zero_difference():
    actor = FakeActor()
    res = _sync(actor, FakeEngine(actor)).sync()
    assert res.max_logprob_diff == 0.0 and res.buckets == 1


def test_tolerance_is_relative_to_the_logprob_magnitude_on_the_random_tokens():
    big = FakeActor(scale=40.0)  # |logp| = 40 .. 280
    tol = _sync(big, FakeEngine(big)).tolerance
    assert 0 < tol < 1e-3  # float32 default
    # an absolute error of 20 * tol on the random prompt tokens is rounding sized next to |logp| >= 40
    # (0.5 tol relative): passes
    res = _sync(big, FakeEngine(big, lambda t: 20 * tol if t < HALF else 0.0)).sync()
    assert res.max_logprob_diff == pytest.approx(20 * tol, rel=1e-6) and res.greedy_logprob_diff == 0.0
    # the same absolute error on log-probs of magnitude < 1 is 20 tol relative: a wrong weight
    small = FakeActor(scale=0.1)
    with pytest.raises(WeightSyncError, match=rf"by up to {20 * tol:.3g} .*random prompt .*> sync.probe_tolerance"):
        _sync(small, FakeEngine(small, lambda t: 20 * tol)).sync()
    # just under / over the bound at |logp| < 1
    assert _sync(small, FakeEngine(small, lambda t: 0.9 * tol)).sync().max_logprob_diff < tol
    with pytest.raises(WeightSyncError):
        _sync(small, FakeEngine(small, lambda t: 1.1 * tol)).sync()
    # one bad position is enough
    with pytest.raises(WeightSyncError):
        _sync(big, FakeEngine(big, lambda t: 1.0 if t == 5 else 0.0)).sync()


def test_the_greedy_continuation_is_bounded_in_absolute_terms():
    """A wrong tensor moves log-probs by about the same absolute amount whatever their size: on the
    greedy continuation the mean |difference| is bounded by the tolerance itself, not scaled by |logp|."""
    big = FakeActor(scale=40.0)
    sync = _sync(big, FakeEngine(big), param_dtype=torch.bfloat16)
    assert (sync.tolerance, sync.greedy_tolerance) == (5e-2, 0.25)
    assert _sync(big, FakeEngine(big)).greedy_tolerance == 1e-4  # float32
    err = FakeEngine(big, lambda t: 1.5 if t >= HALF else 0.0)  # 1.5 nats: under 5e-2 of |logp| >= 40
    with pytest.raises(WeightSyncError, match=r"1.5 on average over the greedy continuation.*greedy_tolerance 0.25"):
        _sync(big, err, param_dtype=torch.bfloat16).sync()
    # the mean, not the max: one token at 3 tol among HALF is noise-sized on average
    one = FakeEngine(big, lambda t: 0.3 if t == HALF else 0.0)
    res = _sync(big, one, param_dtype=torch.bfloat16).sync()
    assert res.greedy_logprob_diff == pytest.approx(0.3 / HALF) and res.max_logprob_diff == pytest.approx(0.3)
    # an explicit bound wins over the dtype's
    with pytest.raises(WeightSyncError, match="greedy_tolerance 0.01"):
        _sync(big, one, param_dtype=torch.bfloat16, probe_greedy_tolerance=0.01).sync()


def test_default_tolerance_follows_the_dtype_sent():
    actor = FakeActor(scale=0.5)
    err = FakeEngine(actor, lambda t: 0.02)  # 0.02 / max(1, |logp|) <= 0.02
    assert _sync(actor, err, param_dtype=torch.bfloat16).sync().max_logprob_diff == pytest.approx(0.02)
    assert _sync(actor, err, dtype="bfloat16").tolerance == 5e-2
    assert _sync(actor, err).tolerance < 5e-2
    with pytest.raises(WeightSyncError):
        _sync(actor, err).sync()  # float32 default
    with pytest.raises(WeightSyncError):
        _sync(actor, FakeEngine(actor, lambda t: 0.2), param_dtype=torch.bfloat16).sync()
    # an explicit tolerance wins over the dtype default
    explicit = {"probe_tolerance": 0.05, "probe_greedy_tolerance": 0.05}
    assert _sync(actor, err, **explicit).sync().max_logprob_diff == pytest.approx(0.02)
    with pytest.raises(WeightSyncError):
        _sync(actor, err, param_dtype=torch.bfloat16, probe_tolerance=0.01).sync()


def test_no_probe_sequences_means_no_probe():
    actor = FakeActor()
    res = _sync(actor, FakeEngine(actor, lambda t: 100.0), probe_sequences=0).sync()
    assert math.isnan(res.max_logprob_diff)


def test_probe_prompts_are_fixed_and_in_vocabulary():
    a, b = probe_prompts(VOCAB, 3), probe_prompts(VOCAB, 3)
    assert a == b and len(a) == 3 and {len(r) for r in a} == {HALF}
    assert max(map(max, a)) < VOCAB and min(map(min, a)) >= 0
    assert a != probe_prompts(VOCAB, 3, seed=7)


def test_every_rank_scores_the_first_rank_s_continuation():
    actor = FakeActor()
    sync = _sync(actor, FakeEngine(actor))
    p = sync.probe_batch()
    assert p.input_ids[:, :HALF].tolist() == probe_prompts(VOCAB, 2)
    assert p.response_mask.sum().item() == 2 * (PROBE_LEN - HALF)
