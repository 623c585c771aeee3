"""The critic's value head under TP=2 equals one process (sequence parallelism needs TE/Apex, so
its gather path is GPU-only and unverified here).

Each layout: build the critic from the actor (values must start at exactly 0: zero head), compute
GAE targets, take one critic step, and compare the new values and the grad norm across layouts. A
second critic initialised from the HF directory (``critic.init=<path>``) must take the identical
step (its trunk is the same weights).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import hf_config, make_qwen2, run_config, sample_batch
from _dist import run_distributed

VOCAB = 255


def _body(rank, world, model_dir, tp):  # noqa: ARG001
    from pacs_megatron.actor.critic import MegatronCritic
    from pacs_megatron.config import CriticConfig, OptimizerConfig
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.pacs import gae_advantages, outcome_token_rewards
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir, tp=tp)
    critic_cfg = CriticConfig(optim=OptimizerConfig(lr=0.5, weight_decay=0.0, adam_eps=1.0), cliprange_value=0.3)
    cfg = replace(cfg, critic=critic_cfg)
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    actor = build_actor(cfg, groups, model_dir)
    batch = sample_batch(VOCAB)
    out = {}
    for init in ("actor", model_dir):
        critic = MegatronCritic(replace(critic_cfg, init=init), groups, actor)
        v0 = critic.compute_values(batch, micro_batch_size=2)
        rewards = outcome_token_rewards(batch.scores, batch.response_mask)
        adv, ret = gae_advantages(rewards, v0, batch.response_mask, 1.0, 1.0)
        m = critic.train_step(replace(batch, advantages=adv, old_values=v0, returns=ret))
        out[init == "actor"] = {"v0": v0, "v1": critic.compute_values(batch, micro_batch_size=4), "m": m}
    return out


@pytest.mark.distributed
def test_value_head_tp2_equals_tp1(tmp_path):
    model_dir = make_qwen2(tmp_path / "m", vocab=VOCAB, layers=2)
    (one,) = run_distributed(_body, 1, model_dir, 1)
    two = run_distributed(_body, 2, model_dir, 2)
    for from_actor in (True, False):
        ref = one[from_actor]
        assert torch.equal(ref["v0"], torch.zeros_like(ref["v0"]))
        assert ref["v1"].abs().max() > 1e-3  # the step moved the head
        assert ref["m"]["critic/value_loss"] > 0 and 0 <= ref["m"]["critic/vf_clipfrac"] <= 1
        for r in two:  # both TP ranks hold the full values
            got = r[from_actor]
            torch.testing.assert_close(got["v1"], ref["v1"], rtol=1e-4, atol=1e-5)
            for k in ("critic/value_loss", "critic/grad_norm", "critic/vf_clipfrac"):
                assert abs(got["m"][k] - ref["m"][k]) <= 1e-5 * max(1.0, abs(ref["m"][k])), k
    # HF-path init == copy of the actor: the same step, the same values.
    torch.testing.assert_close(one[False]["v1"], one[True]["v1"], rtol=0, atol=1e-6)
