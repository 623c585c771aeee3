"""The stage that draws the step's prompts and assembles its batch: dynamic sampling (DAPO's group
filtering) and overlong shaping around ``stages.generate_scored`` / ``stages.assemble_batch``.

    filter_groups=none    draw train_batch_size prompts -> generate + score -> batch     (exactly as before)
    filter_groups=mixed   rounds of draw -> generate + score -> keep mixed groups, until train_batch_size
                          groups are kept or max_gen_batches rounds ran -> the first train_batch_size kept
                          groups -> batch; the prompts drawn after the last trained one go back to the stream
    then                  overlong: reward penalty (GRPO/PPO) and/or weight 0 for truncated rows

The maths (which groups, the penalty) is pure torch in pacs/group_filter.py and pacs/overlong.py.
Every rank runs the same rounds: generation and scoring are gathered to all ranks, so every rank
keeps the same groups and moves its prompt stream the same way. The stream's state stays the
dataset's ``(epoch, position)``: a step consumes exactly the prompts up to its last trained one, so a
resumed run draws what the uninterrupted run drew (tests/test_sampling_stages.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.config import RunConfig
from pacs_megatron.loop import stages
from pacs_megatron.loop.stages import ScoredGroups
from pacs_megatron.pacs.group_filter import filter_metrics, keep_groups, take_groups
from pacs_megatron.pacs.overlong import overlong_metrics, overlong_penalty, truncation_weights
from pacs_megatron.utils.logging import get_logger

if TYPE_CHECKING:
    from pacs_megatron.loop.runtime import Components

logger = get_logger(__name__)


class ShortBatchError(RuntimeError):
    """Dynamic sampling kept too few groups for the configured step (see the message for the fix)."""


def collect_step(cfg: RunConfig, c: Components, step: int) -> tuple[Rollouts, dict, list]:
    """The step's batch (all rows, every rank), its metrics and a few samples; collective."""
    if cfg.algorithm.filter_groups == "none":
        scored = stages.generate_scored(cfg, c, c.dataset.next_batch(cfg.trainer.train_batch_size), step)
        metrics: dict = {}
    else:
        scored, metrics = filtered_groups(cfg, c, step)
    batch, batch_metrics, samples = stages.assemble_batch(cfg, c, scored, step)
    batch, shaping = shape_overlong(cfg, batch, scored)
    return batch, batch_metrics | metrics | shaping, samples


def filtered_groups(cfg: RunConfig, c: Components, step: int) -> tuple[ScoredGroups, dict]:
    """Generation rounds until ``train_batch_size`` groups pass ``algorithm.filter_groups`` (module docstring)."""
    algo, n, need = cfg.algorithm, cfg.rollout.n, cfg.trainer.train_batch_size
    start = c.dataset.state_dict()
    rounds: list[ScoredGroups] = []
    keeps: list[torch.Tensor] = []
    kept = 0
    for r in range(algo.max_gen_batches):
        draw = algo.gen_batch_size or (need if r == 0 else need - kept)
        scored = stages.generate_scored(cfg, c, c.dataset.next_batch(draw), step, round_=r)
        keeps.append(keep_groups(torch.tensor(scored.scores, dtype=torch.float32), n, algo.filter_groups))
        rounds.append(scored)
        kept += int(keeps[-1].sum())
        if kept >= need:
            break
    keep = torch.cat(keeps)
    chosen, consumed = take_groups(keep, need, cfg.mini_batch_prompts)
    # The stream moves past the last trained prompt only: later draws go back for the next step.
    c.dataset.load_state_dict(start)
    c.dataset.next_batch(consumed)
    metrics = filter_metrics(len(keep), kept, len(chosen), len(rounds), len(keep) - consumed)
    if len(chosen) < need:
        _short_batch(cfg, kept, len(chosen), len(rounds))
    return _select(rounds, chosen, n), metrics


def _short_batch(cfg: RunConfig, kept: int, trained: int, rounds: int) -> None:
    """Warn (``short_batch=train``, whole mini-batches left) or raise, in one line naming the fix."""
    algo, need, mini = cfg.algorithm, cfg.trainer.train_batch_size, cfg.mini_batch_prompts
    what = (
        f"dynamic sampling (algorithm.filter_groups={algo.filter_groups}): {kept} of the {need} groups a step needs "
        f"after {rounds} generation rounds (algorithm.max_gen_batches={algo.max_gen_batches})"
    )
    if algo.short_batch == "train" and trained:
        logger.warning("%s; training on %d groups (%d mini-batches of %d)", what, trained, trained // mini, mini)
        return
    fix = "raise algorithm.max_gen_batches or algorithm.gen_batch_size"
    if algo.short_batch == "train":
        fix += f", lower algorithm.mini_batch_size (a step trains whole mini-batches of {mini} prompts)"
    else:
        fix += ", or set algorithm.short_batch=train"
    msg = f"{what}: {fix}, or set algorithm.filter_groups=none"
    logger.error("%s", msg)
    raise ShortBatchError(msg)


def _select(rounds: list[ScoredGroups], chosen: list[int], n: int) -> ScoredGroups:
    """The ``chosen`` groups (indices over all rounds' prompts, in draw order) as one round; the scorer's
    counters are summed over every round (all their rows were scored)."""
    records = [rec for r in rounds for rec in r.records]
    groups = [g for r in rounds for g in r.groups]
    scores = [s for r in rounds for s in r.scores]
    totals: dict = {}
    for r in rounds:
        for k, v in r.reward_metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return ScoredGroups(
        records=[records[i] for i in chosen],
        groups=[groups[i] for i in chosen],
        scores=[s for i in chosen for s in scores[i * n : (i + 1) * n]],
        reward_metrics=totals,
    )


def shape_overlong(cfg: RunConfig, batch: Rollouts, scored: ScoredGroups) -> tuple[Rollouts, dict]:
    """``algorithm.overlong``: the soft punishment added to the rewards, truncated rows' loss weight set to 0
    (``is_weights``; rollout correction multiplies into it later). Unchanged batch when both are off."""
    over = cfg.algorithm.overlong
    if not over.buffer_len and not over.mask_truncated:
        return batch, {}
    responses = [resp for _, resp in scored.rows()]
    lengths = torch.tensor([r.policy_tokens for r in responses])  # tool output is not the policy's length
    truncated = torch.tensor([r.truncated for r in responses], dtype=torch.bool)
    penalty = overlong_penalty(lengths, cfg.rollout.max_response_length, over.buffer_len, over.penalty_factor)
    metrics = overlong_metrics(penalty, truncated, over.mask_truncated)
    if over.buffer_len:
        batch = replace(batch, scores=batch.scores + penalty)
        metrics["reward/shaped_mean"] = batch.scores.mean()
    if over.mask_truncated:
        batch = replace(batch, is_weights=truncation_weights(truncated, batch.is_weights))
    return batch, metrics
