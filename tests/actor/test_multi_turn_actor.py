"""Tool output in the Megatron actor (issue 45): a trajectory's tool tokens are read by the forward pass and
counted by nothing else.

- The log-prob of a trajectory prompt -> a1 -> tool -> a2 over its policy tokens equals the sum of two
  single-turn rows, prompt -> a1 and (prompt + a1 + tool) -> a2: the tool output is context, fixed.
- PACS and GRPO: values at tool positions (old, reference, engine log-probs) change no loss, metric or
  gradient, bit for bit; and the trajectory's PACS loss equals the loss of the single-turn rows' sums.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import hf_config, make_qwen2, run_config
from _dist import run_distributed

from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.batch.rows import TrainRows, as_train_batch
from pacs_megatron.pacs import PACSConfig, PolicyLossConfig, outcome_advantages
from pacs_megatron.pacs.loss import pacs_loss

VOCAB, N = 255, 2


def _trajectories():
    """One prompt, N trajectories prompt -> a1 -> tool -> a2 of ragged lengths; scores 1, 0."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, VOCAB, (5,), generator=g).tolist()
    rows = []
    for k in range(N):
        a1, tool, a2 = (torch.randint(1, VOCAB, (m + k,), generator=g).tolist() for m in (3, 4, 2))
        rows.append((a1, tool, a2))
    return prompt, rows


def _body(rank, world, model_dir):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    prompt, rows = _trajectories()
    masks = [[True] * len(a1) + [False] * len(t) + [True] * len(a2) for a1, t, a2 in rows]
    traj = build_rollouts([prompt] * N, [a1 + t + a2 for a1, t, a2 in rows], [1.0, 0.0], N, 0, 8, policy_masks=masks)
    first = build_rollouts([prompt] * N, [a1 for a1, _, _ in rows], [1.0, 0.0], N, 0, 8)
    second = build_rollouts([prompt + a1 + t for a1, t, _ in rows], [a2 for _, _, a2 in rows], [1.0, 0.0], N, 0, 8)
    out: dict = {}
    cfg = run_config(model_dir)
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    actor = build_actor(cfg, groups, model_dir)
    for name, b in (("traj", traj), ("first", first), ("second", second)):
        out[name] = actor.compute_logprobs(b, N, 1.0, response_only=True).token_logp
    # the same step from fresh actors: tool positions of every other input filled with garbage must not matter
    for loss in ("pacs", "grpo"):
        for garbage in (False, True):
            c = replace(cfg, algorithm=replace(cfg.algorithm, loss=loss, kl_loss_coef=0.1, kl_loss_type="k3"))
            fresh = build_actor(c, groups, model_dir)
            old = out["traj"] - 0.05 * traj.response_mask  # pi_old a little below: r != 0, the classifier acts
            ref = out["traj"] - 0.1 * traj.response_mask
            if garbage:
                tool = (~traj.response_mask) & (torch.arange(traj.input_ids.shape[1]) < traj.seq_lens[:, None])
                old, ref = old + 7.0 * tool, ref - 3.0 * tool
            adv = outcome_advantages(traj.scores, N, PolicyLossConfig(adv_estimator="grpo"))
            batch = as_train_batch(TrainRows.of(traj, advantages=adv), old, ref_logp=ref)
            out[(loss, garbage)] = fresh.train_step(batch)
    return out


@pytest.mark.distributed
def test_tool_tokens_are_context_for_the_forward_and_nothing_else(tmp_path):
    model_dir = make_qwen2(tmp_path / "m", vocab=VOCAB)
    [out] = run_distributed(_body, 1, model_dir)
    prompt, rows = _trajectories()
    traj, first, second = out["traj"], out["first"], out["second"]
    seq = traj.sum(-1)
    pieces = first.sum(-1) + second.sum(-1)
    torch.testing.assert_close(seq, pieces, rtol=0, atol=2e-5)
    # tool positions hold nothing: the loss reads log-probs at policy tokens only
    for b, (a1, t, _) in enumerate(rows):
        start = len(prompt) + len(a1)
        assert torch.count_nonzero(traj[b, start : start + len(t)]) == 0
    for loss in ("pacs", "grpo"):
        assert out[(loss, False)] == out[(loss, True)], loss
    # the trajectory's PACS loss is the single-turn loss of its policy tokens' sums (pi_old 0.05 below per token)
    scores, policy = torch.tensor([1.0, 0.0]), torch.zeros_like(traj, dtype=torch.bool)
    for b, (a1, t, a2) in enumerate(rows):
        s = len(prompt)
        policy[b, s : s + len(a1)] = policy[b, s + len(a1) + len(t) : s + len(a1) + len(t) + len(a2)] = True
    lengths = policy.sum(-1)
    single, _ = pacs_loss(
        pieces[:, None], (pieces - 0.05 * lengths)[:, None], torch.ones(N, 1), scores, N, PACSConfig()
    )
    multi, _ = pacs_loss(traj, traj - 0.05 * policy, policy, scores, N, PACSConfig())
    torch.testing.assert_close(multi, single, rtol=0, atol=1e-5)  # the sums agree within 2e-5 (shapes differ)
