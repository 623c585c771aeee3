"""The asynchronous loop keeps the last trained step when a weight-sync check fails (issue #40 R3).

In the step loop with separate engines (``sources.Pipelined``) the engines' probe of the weights pushed after
step s - 1 is verified when step s's
rollouts are taken (async_stages.take_batch). A WeightSyncError there must checkpoint step s - 1 before
it propagates, as the synchronous loop's ``_synced`` does, or up to ``save_freq - 1`` trained steps are
lost. The stages are stubbed: this checks the loop's order of saving and raising, in-process.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pacs_megatron.config.training import TrainerConfig
from pacs_megatron.loop import async_stages, sources, train
from pacs_megatron.weight_sync import WeightSyncError


def _loop(monkeypatch, start: int, fail_at: int) -> list[int]:
    """Run the step loop over a pipelined source from ``start``, take_batch failing its verify at step ``fail_at``;
    the saved steps."""
    saved: list[int] = []

    def take_batch(cfg, c, pipe, step):
        if step == fail_at:
            raise WeightSyncError("engine 0 does not hold the actor's weights (planted)")
        return None, {}, []

    monkeypatch.setattr(async_stages, "start_pipeline", lambda cfg, c, s: SimpleNamespace(pushed=lambda step: None))
    monkeypatch.setattr(async_stages, "take_batch", take_batch)
    monkeypatch.setattr(async_stages, "push_weights", lambda cfg, c, step: {})
    monkeypatch.setattr(train, "_update", lambda run, batch, timer, step: {})
    monkeypatch.setattr(train, "_end_step", lambda *a: None)  # no periodic saves: save_freq is not due
    run = SimpleNamespace(
        cfg=SimpleNamespace(trainer=TrainerConfig(total_steps=10, test_freq=0)),
        c=SimpleNamespace(save=lambda d, s: None),
        ckpt=SimpleNamespace(save=lambda step, write: saved.append(step)),
        memory=SimpleNamespace(start=lambda: None),
    )
    with pytest.raises(WeightSyncError, match="planted"):
        train._steps(run, start, sources.Pipelined(run.cfg, run.c, start))
    return saved


def test_a_failed_verify_saves_the_last_trained_step(monkeypatch):
    assert _loop(monkeypatch, start=2, fail_at=5) == [4]  # steps 3 and 4 trained: 4 is kept
    assert _loop(monkeypatch, start=2, fail_at=3) == []  # nothing trained since the resumed step 2
