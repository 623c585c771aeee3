"""The bitwise check with engines on their own processes (rollout.placement=separate), for real: this process is
trainer rank 0 of a world of one, one ``python -m pacs_megatron.launch.engine_rank`` HF engine process, the
weights over the gloo weight group. The engine fingerprints what arrived (the trainer compares it with what it
sent: the transport) and what it holds after the load (against what arrived, cast to its dtype: the load).

A correct sync passes; a load planted wrong at version 1 (PACS_ENGINE_STALE_TENSOR) raises WeightSyncError naming
the tensor, engine and version (the probe is off: the check alone); the next correct version passes again.
The engine-side probe's greedy bound applies from the second version on.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
from _remote import remote_engines

from pacs_megatron.rollout.remote.server import STALE_ENV
from pacs_megatron.weight_sync import WeightSyncError

pytestmark = pytest.mark.distributed
STALE = "model.layers.1.self_attn.v_proj.bias"


@contextmanager
def remote(tmp_path, monkeypatch, *overrides: str):
    """(RemoteWeightSync, actor) over one HF engine process in bf16 (an fp32 actor: the engine casts), with the
    load of version 1 planted wrong (PACS_ENGINE_STALE_TENSOR)."""
    with remote_engines(tmp_path, monkeypatch, 1, ["model.dtype=bfloat16", *overrides], {STALE_ENV: f"1:{STALE}"}) as (
        _,
        sync,
        actor,
        _,
        _,
    ):
        yield sync, actor


def test_a_planted_bad_load_on_an_engine_process_is_named(tmp_path, monkeypatch):
    with remote(tmp_path, monkeypatch, "sync.probe_sequences=0") as (sync, actor):  # the bitwise check alone
        actor.move(seed=1)
        result = sync.sync(version=0, wait=True)  # fp32 on the wire, cast by the bf16 engine on its copy
        assert result.bitwise_tensors == len(actor.hf.model.state_dict()) - 1  # all but the tied alias lm_head
        assert result.bitwise_seconds >= 0
        actor.move(seed=2)
        with pytest.raises(WeightSyncError, match=rf"engine 0, version 1.*{STALE.replace('.', '[.]')} differ"):
            sync.sync(version=1, wait=True)
        actor.move(seed=3)
        sync.sync(version=2, wait=True)  # a correct load passes again


def test_the_engine_side_probe_has_a_greedy_bound(tmp_path, monkeypatch):
    """From the second version on, the probe continues its prompts with the engine's greedy continuation of the
    version before, and the mean difference there is bounded (here a bound no bf16 engine meets: it raises)."""
    overrides = ("sync.verify_bitwise=false", "sync.probe_tolerance=1.0", "sync.probe_greedy_tolerance=1e-9")
    with remote(tmp_path, monkeypatch, *overrides) as (sync, actor):
        first = sync.sync(version=0, wait=True)
        assert math.isnan(first.greedy_logprob_diff) and sync.continuation is not None  # random tokens only
        actor.move(seed=2)
        with pytest.raises(WeightSyncError, match="greedy continuation"):
            sync.sync(version=1, wait=True)
