"""reward.backend=ray on a real two-node Ray cluster scores exactly like the local process pool."""

from __future__ import annotations

import os

import pytest

from pacs_megatron.config import ConfigError, RewardConfig
from pacs_megatron.reward import RewardScorer


@pytest.mark.distributed
def test_ray_backend_matches_local_pool_with_raising_and_hanging_rewards(ray_cluster, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    responses = ["3", "raise", "hang", "4", "3", "5"]
    answers = ["3", "3", "3", "3", "3", "5"]
    results, nodes = {}, set()
    for backend in ("local", "ray"):
        cfg = RewardConfig(fn="reward_user_fns:alarm_raise_or_hang", num_workers=2, timeout_s=2.0, backend=backend)
        with RewardScorer(cfg) as scorer:
            results[backend] = scorer.score(["p"] * len(responses), responses, answers)
            if backend == "ray":
                nodes = {s.node_id for s in scorer._backend._slots}
    scores, metrics = results["local"]
    # A healthy answer later than timeout_s would be a timeout: the load says whether the machine was starved
    seen = f"{results} at a load average of {os.getloadavg()[0]:.0f} on {os.cpu_count()} cores"
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], seen
    assert metrics == {"reward/timeouts": 1.0, "reward/errors": 1.0, "reward/worker_restarts": 1.0}, seen
    assert results["ray"] == results["local"], seen
    assert len(nodes) == 2, f"the reward actors should spread over both nodes, got {nodes}"

    # The actors score at the job's priority, not at Ray's worker niceness (15): beside other work on the
    # node a nice-15 worker starved, and a healthy answer became a timeout.
    with RewardScorer(RewardConfig(fn="reward_user_fns:niceness", num_workers=1, backend="ray")) as scorer:
        assert scorer.score(["p"], ["r"], ["a"])[0] == [0.0]


def test_ray_backend_needs_workers():
    with pytest.raises(ConfigError, match="reward.num_workers"):
        RewardConfig(fn="arith", num_workers=0, backend="ray")
