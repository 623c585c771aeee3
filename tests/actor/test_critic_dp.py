"""PPO with a learned critic at DP=2: every row gets its own advantages, returns and old values.

With dynamic batching, ``dp_balanced_shard`` gives each DP rank a token-balanced, non-contiguous set
of prompt groups. The step's stages (``update_stages.prepare_local_batch`` with ``critic_stages.advantages_of``,
``critic_stages.update_critic``, ``update_stages.update_actor``) run for real on a tiny Qwen2 at DP=1, at DP=2
with contiguous shards and at DP=2 with dynamic batching; per row (found by its global group id) the
advantages, returns and old values, and the step's actor and critic gradient norms, must all agree.
Before the step, one supervised actor step stands in for the format warm-up: afterwards
``critic_stages.init_after_warmup`` must leave the critic's trunk equal to the warmed-up actor's.

Fixed batching at DP=2 cuts each rank's contiguous share into mini-batches, so its global mini-batch k
holds other groups than DP=1's; its gradient norms are compared with one mini-batch per step. Dynamic
batching balances each global mini-batch over the ranks: two mini-batches, the DP=1 split.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from _actor_helpers import GROUP, hf_config, make_qwen2, run_config, sample_batch
from _dist import run_distributed

from pacs_megatron.batch.rows import as_train_batch

VOCAB = 255
GROUPS = 8  # prompt groups per step
# (dynamic batching, prompts per mini-batch) run in each launch; DP=1's are the references
DP2_RUNS = ((False, GROUPS), (True, GROUPS // 2))
DP1_RUNS = ((False, GROUPS), (False, GROUPS // 2))
KEYS = ("advantages", "returns", "old_values")


def _config(model_dir: str, dp: int, dynamic: bool, mini: int = GROUPS):
    from pacs_megatron.config import CriticConfig, OptimizerConfig
    from pacs_megatron.pacs import PolicyLossConfig

    cfg = run_config(model_dir, dp=dp)
    policy = PolicyLossConfig(adv_estimator="gae", loss_agg_mode="seq-mean-token-sum-norm", loss_agg_horizon=16)
    return replace(
        cfg,
        data=replace(cfg.data, max_prompt_length=8),
        rollout=replace(cfg.rollout, max_response_length=8),
        trainer=replace(cfg.trainer, train_batch_size=GROUPS),
        algorithm=replace(
            cfg.algorithm,
            loss="ppo",
            policy=policy,
            mini_batch_size=mini,
            dynamic_batching=dynamic,
            max_tokens_per_micro_batch=64,
        ),
        critic=CriticConfig(optim=OptimizerConfig(lr=0.05, weight_decay=0.0, adam_eps=1.0), cliprange_value=0.3),
    )


def _trunk_diff(actor, critic) -> float:
    """max |actor - critic| over the parameters they share (all but the LM / value head)."""
    from pacs_megatron.actor.weights import unwrap

    a = dict(unwrap(actor.model[0]).named_parameters())
    return max(
        float((p - a[n]).abs().max())
        for n, p in unwrap(critic.model[0]).named_parameters()
        if not n.startswith("output_layer.")
    )


def _body(rank, world, model_dir, runs):  # noqa: ARG001
    from pacs_megatron.actor.critic import MegatronCritic
    from pacs_megatron.actor.weights import unwrap
    from pacs_megatron.batch.build import dp_shard
    from pacs_megatron.loop import critic_stages, update_stages
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    groups = initialize_parallel(_config(model_dir, world, False).parallel, hf_config(model_dir))
    batch = sample_batch(VOCAB, groups=GROUPS)
    out = {}
    for dynamic, mini in runs:
        cfg = _config(model_dir, world, dynamic, mini)
        actor = build_actor(cfg, groups, model_dir)
        # A value head that is not 0, so the critic's values differ from row to row before any update.
        critic = MegatronCritic(cfg.critic, groups, actor)
        for p in unwrap(critic.model[0]).output_layer.parameters():
            torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(7))
        c = SimpleNamespace(critic=critic, actor=actor, rt=SimpleNamespace(groups=groups))
        sft = dp_shard(batch, groups.dp_rank, world)
        actor.train_step(as_train_batch(sft, torch.zeros(sft.input_ids.shape)), loss_name="sft")
        before = _trunk_diff(actor, critic)
        critic_stages.init_after_warmup(replace(cfg, trainer=replace(cfg.trainer, sft_warmup_steps=1)), c)
        gae = critic_stages.advantages_of(cfg, c)
        local, old, gae_metrics = update_stages.prepare_local_batch(cfg, actor, batch, groups.dp_rank, world, gae)
        after = _trunk_diff(actor, critic)
        critic_metrics = critic_stages.update_critic(cfg, c, local)
        actor_metrics = update_stages.update_actor(cfg, actor, local, old, world)
        out[dynamic, mini] = {
            "group_ids": local.group_ids,
            **{k: getattr(local, k) for k in KEYS},
            "gae": gae_metrics,
            "critic_grad_norm": critic_metrics["critic/grad_norm"],
            "actor_grad_norm": actor_metrics["actor/grad_norm"],
            "trunk_diff": (before, after),
        }
    return out


def _global_rows(results: list[dict], run: tuple) -> dict[str, torch.Tensor]:
    """Every rank's rows put back at their global position (group id x n + index in the group)."""
    out = {}
    for key in KEYS:
        full = torch.full((GROUPS * GROUP, results[0][run][key].shape[1]), float("nan"))
        for r in results:
            idx = r[run]["group_ids"] * GROUP + torch.arange(len(r[run]["group_ids"])) % GROUP
            full[idx] = r[run][key]
        out[key] = full
    return out


@pytest.mark.distributed
def test_critic_rows_at_dp2_dynamic_equal_dp1(tmp_path):
    model_dir = make_qwen2(tmp_path / "m", vocab=VOCAB, layers=2)
    (one,) = run_distributed(_body, 1, model_dir, DP1_RUNS)
    two = run_distributed(_body, 2, model_dir, DP2_RUNS)
    rank0_groups = two[0][DP2_RUNS[1]]["group_ids"][::GROUP].tolist()
    assert rank0_groups != list(range(GROUPS // 2)), "the test needs a non-contiguous DP shard"
    for r in [one, *two]:
        for run, res in r.items():
            before, after = res["trunk_diff"]
            assert before > 1e-4 and after == 0.0, (run, before, after)  # warm-up moved the actor; re-copied
    ref = _global_rows([one], DP1_RUNS[0])
    assert ref["old_values"].abs().max() > 1e-3 and ref["advantages"].abs().max() > 0.1
    # Per-row tensors come before any update: one reference for every run.
    for results, run in ((two, DP2_RUNS[0]), (two, DP2_RUNS[1]), ([one], DP1_RUNS[1])):
        got = _global_rows(results, run)
        for key in KEYS:
            torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=1e-5, msg=f"{key} {run}")
    # Gradient norms and the GAE metrics: each DP=2 run against DP=1 with the same mini-batches.
    for run, ref_run in zip(DP2_RUNS, DP1_RUNS):
        want = one[ref_run]
        for r in two:
            for key in ("critic_grad_norm", "actor_grad_norm"):
                assert abs(r[run][key] - want[key]) <= 1e-5 * max(1.0, want[key]), (key, run, r[run][key], want[key])
            for key, v in want["gae"].items():
                assert abs(r[run]["gae"][key] - v) <= 1e-5 * max(1.0, abs(v)), (key, run)
