"""A short real training run of a tiny Qwen3-MoE (4 experts, top-2, head_dim 32) with ``rollout.engine=vllm``
on CPU: the actor at TP=1 x EP=2 x DP=2 (two ranks, each expert whole on one of them), one vLLM TP=1 replica
per rank. Every sync sends the full expert set (each rank receives the experts of the other rank's EP shard
by the export's broadcast), vLLM's CPU MoE kernel is repacked after the reload, and the post-sync probe
(vLLM against the Megatron actor) must stay <= 1e-5 at every step; ``rollout/logprob_diff_*`` (vLLM's
sampled-token log-probs against the actor's old log-probs, rollout_correction.py) are logged."""

from __future__ import annotations

import math
import subprocess

import pytest
from _runs import SHORT, metrics_rows, train_cmd
from _vllm import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]  # an engine starts: the slow tier
MOE = [
    "model.tiny.architecture=qwen3_moe",
    "model.tiny.num_experts=4",
    "model.tiny.num_experts_per_tok=2",
    "parallel.tp=1",
    "parallel.ep=2",
    "parallel.dp=2",
]
"""docs/models.md's MoE variant of the CPU default (hidden 128 / 4 heads: head_dim 32, which vLLM's CPU
attention supports; 16 is refused)."""


@pytest.mark.slow
@pytest.mark.distributed
def test_short_moe_training_run_with_vllm_at_ep2(tmp_path):
    cmd = train_cmd(tmp_path, 2, *SHORT, *MOE, "rollout.engine=vllm")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vLLM engine on cpu (float32): replica 0 of 2 (tp=1)" in proc.stderr
    # vLLM's reload only warns on a layer it got nothing for: the tied head (rebuilt by refresh_tied_lm_head) and
    # the rotary embedding (a computed buffer) are expected; an expert layer there would be a partial sync
    unloaded = {ln.split("] ")[-1] for ln in proc.stderr.splitlines() if "Failed to load weights" in ln}
    assert unloaded <= {"ParallelLMHead: Failed to load weights", "RotaryEmbedding: Failed to load weights"}, unloaded
    rows = metrics_rows(tmp_path)
    assert sorted(rows) == [1, 2]
    for step, r in rows.items():
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), step
        assert r["sync/max_logprob_diff"] <= 1e-5, (step, r["sync/max_logprob_diff"])
        assert 0.0 < r["rollout/logprob_diff_mean"] <= r["rollout/logprob_diff_max"] <= 1e-4, step
        assert r["moe/max_token_share"] >= 1.0  # the MoE metrics are logged (busiest expert / mean)
