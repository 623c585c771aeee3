"""Reward safety in every mode: timeouts with num_workers=0, failing steps stop the run, a stop
signal abandons a hung batch, and the chunked pool keeps order."""

import time

import pytest

from pacs_megatron.config import ConfigError, RewardConfig
from pacs_megatron.reward import RewardFailureError, RewardInterrupted, RewardScorer, score_rollouts
from pacs_megatron.utils import preemption


def _score(scorer, responses, step=False):
    n = len(responses)
    return score_rollouts(scorer, ["p"] * n, responses, ["a"] * n, [None] * n, sharded=False, step=step)


@pytest.mark.subprocess
def test_default_mode_times_out_a_hang_and_keeps_order():
    """num_workers=0 (the CPU default) is one worker with deadlines: a response that spins forever
    costs one timeout; the others keep their place, across chunk boundaries."""
    with RewardScorer(RewardConfig(fn="reward_user_fns:hang", num_workers=0, timeout_s=1.0)) as s:
        _score(s, ["warm"])
        responses = ["ok"] * 300 + ["hang"] + ["ok"] * 300
        t0 = time.monotonic()
        scores, m = _score(s, responses)
        assert time.monotonic() - t0 < 20.0
    assert scores == [1.0] * 300 + [0.0] + [1.0] * 300
    assert m["reward/timeouts"] == 1.0 and m["reward/worker_restarts"] == 1.0 and m["reward/errors"] == 0.0
    assert s.last_error.startswith("timed out after reward.timeout_s=1s")

    with RewardScorer(RewardConfig(fn="reward_user_fns:exact", num_workers=2)) as s:
        scores, _ = score_rollouts(s, ["p"] * 500, [str(i % 7) for i in range(500)], ["3"] * 500, None, False)
    assert scores == [float(i % 7 == 3) for i in range(500)]


@pytest.mark.subprocess
def test_all_failed_steps_stop_with_the_function_and_its_error():
    with RewardScorer(RewardConfig(fn="reward_user_fns:raising", num_workers=0, max_failure_steps=2)) as s:
        _score(s, ["raise", "raise"], step=True)
        _score(s, ["raise", "ok"], step=True)  # one response scored: the count restarts
        _score(s, ["raise"] * 3, step=True)
        with pytest.raises(RewardFailureError) as e:
            _score(s, ["raise"] * 3, step=True)
        _score(s, ["raise"] * 3)  # evaluation batches (step=False) never count
    msg = str(e.value)
    assert "reward.fn='reward_user_fns:raising'" in msg and "2 consecutive steps" in msg
    assert "ZeroDivisionError: user bug" in msg
    with pytest.raises(ConfigError, match="reward.max_failure_steps"):
        RewardConfig(max_failure_steps=-1)


@pytest.mark.subprocess
def test_stop_signal_abandons_a_hung_batch():
    """After SIGTERM a batch gets timeout_s more; then it is abandoned and the step raises
    RewardInterrupted (exit code 143, nothing checkpointed) instead of waiting out every timeout."""
    cfg = RewardConfig(fn="reward_user_fns:sleepy", num_workers=0, timeout_s=2.0)
    with RewardScorer(cfg) as s:
        _score(s, ["warm"])
        preemption._STOP_REQUESTED.set()
        try:
            t0 = time.monotonic()
            with pytest.raises(RewardInterrupted) as e:
                _score(s, ["sleep"] * 20, step=True)
            took = time.monotonic() - t0
        finally:
            preemption._STOP_REQUESTED.clear()
        assert took < 10.0, took  # not 20 x 2 s
        assert e.value.code == 143
        scores, m = _score(s, ["ok", "ok"])  # the scorer restarts its worker for the next batch
        assert scores == [1.0, 1.0]
