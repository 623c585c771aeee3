"""The named stages of one RL step before the update, and the validation; ``train.py`` calls them in order and
holds no logic itself (the update's stages: update_stages.py).

Every function here runs on every rank. Host-side work (sampling, scoring) is sharded over ranks
and gathered, so every rank holds the step's whole :class:`Rollouts`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from pacs_megatron.batch.build import build_rollouts, response_values
from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.config import RunConfig
from pacs_megatron.data.records import PromptRecord
from pacs_megatron.data.routing import RoutedExperts
from pacs_megatron.eval.runner import evaluate
from pacs_megatron.reward.rollouts import score_rollouts
from pacs_megatron.reward.verifiers import has_boxed
from pacs_megatron.rollout.multi_turn import turn_metrics
from pacs_megatron.rollout.types import Response, SamplingParams

if TYPE_CHECKING:
    from pacs_megatron.loop.runtime import Components


def train_sampling(cfg: RunConfig) -> SamplingParams:
    return SamplingParams.of_rollout(cfg.rollout)


def val_sampling(cfg: RunConfig) -> SamplingParams:
    """trainer.val_*; ``val_temperature=0`` is greedy: the engines sample, and top_k=1 at T=1 is greedy
    decoding (as the eval CLI does)."""
    t = cfg.trainer
    greedy = t.val_temperature == 0
    return SamplingParams(
        n=t.val_n,
        temperature=1.0 if greedy else t.val_temperature,
        top_p=t.val_top_p,
        top_k=1 if greedy else -1,
        max_tokens=cfg.rollout.max_response_length,
        seed=cfg.rollout.seed,
    )


@dataclass(frozen=True)
class ScoredGroups:
    """One generation round: prompts, their ``n`` responses each, and the verifier's scores.

    Example:
        >>> ScoredGroups(records=[], groups=[], scores=[], reward_metrics={}).rows()
        []
    """

    records: list[PromptRecord]
    """``[P]`` PromptRecords, in the order they were drawn."""
    groups: list[list[Response]]
    """``[P][n]`` responses, group p answering records[p]."""
    scores: list[float]
    """``[P * n]`` verifiable rewards, group-major."""
    reward_metrics: dict
    """The scorer's counters of this round (reward/errors, ...)."""

    def rows(self) -> list[tuple]:
        """``(record, response)`` per row, group-major."""
        return [(rec, resp) for rec, group in zip(self.records, self.groups) for resp in group]


def generate_scored(
    cfg: RunConfig, c: Components, records: list[PromptRecord], step: int, round_: int = 0
) -> ScoredGroups:
    """Sample ``n`` responses per prompt and score them (all rows, every rank). ``round_`` > 0 (a further
    generation round of dynamic sampling) draws from its own seed, reproducibly."""
    sampling = train_sampling(cfg)
    if round_:
        sampling = replace(sampling, seed=cfg.rollout.seed + 104_729 * round_)
    groups = c.engine.generate_step([r.prompt_ids for r in records], sampling, step)
    return score_groups(c, records, groups)


def score_groups(c: Components, records: list[PromptRecord], groups: list[list[Response]]) -> ScoredGroups:
    """Score the responses of ``records`` (``groups``: n per prompt, sampled here or by the engines of the
    asynchronous loop); collective, every rank gets every score."""
    flat = [(rec, resp) for rec, group in zip(records, groups) for resp in group]
    scores, reward_metrics = score_rollouts(
        c.scorer,
        [rec.prompt_text for rec, _ in flat],
        [resp.text for _, resp in flat],
        [rec.answer for rec, _ in flat],
        [dict(rec.extra) if rec.extra else None for rec, _ in flat],
        sharded=True,
        step=True,
    )
    return ScoredGroups(list(records), groups, scores, reward_metrics)


def collect_batch(cfg: RunConfig, c: Components, records: list[PromptRecord], step: int) -> tuple[Rollouts, dict, list]:
    """Sample ``n`` responses per prompt, score them, and pack the step's batch (all rows, every rank)."""
    return assemble_batch(cfg, c, generate_scored(cfg, c, records, step), step)


def assemble_batch(cfg: RunConfig, c: Components, scored: ScoredGroups, step: int) -> tuple[Rollouts, dict, list]:
    """Pack scored rollouts into the step's batch, with its metrics and a few samples for rollouts.jsonl."""
    flat, scores, reward_metrics = scored.rows(), scored.scores, scored.reward_metrics
    batch = build_rollouts(
        [rec.prompt_ids for rec, _ in flat],
        [resp.token_ids for _, resp in flat],
        scores,
        cfg.rollout.n,
        c.pad_id,
        8,
        policy_masks=[resp.policy_mask for _, resp in flat],
    )
    batch = replace(batch, rollout_logp=response_values(batch, [resp.logprobs for _, resp in flat]))
    if cfg.actor.routing_replay == "rollout":  # MoE: the actor replays the engine's experts (data/routing.py)
        routed = RoutedExperts.from_records([resp.routed_experts for _, resp in flat], batch.seq_lens)
        batch = replace(batch, routed_experts=routed)  # this replica's rows only, until prepare_local_batch
    lengths = torch.tensor([resp.policy_tokens for _, resp in flat], dtype=torch.float32)
    s = batch.scores.reshape(-1, cfg.rollout.n)
    metrics = {
        "reward/mean": batch.scores.mean(),
        "reward/accuracy": (batch.scores > 0.5).float().mean(),
        "data/mixed_group_frac": ((s.max(1).values > 0.5) & (s.min(1).values < 0.5)).float().mean(),
        "data/all_correct_group_frac": (s.min(1).values > 0.5).float().mean(),
        "response/length_mean": lengths.mean(),
        "response/length_max": lengths.max(),
        "response/truncation_rate": torch.tensor([float(resp.truncated) for _, resp in flat]).mean(),
        "response/boxed_rate": torch.tensor([float(has_boxed(resp.text)) for _, resp in flat]).mean(),
        "data/tokens": float(batch.seq_lens.sum()),
        **reward_metrics,
        **turn_metrics([resp for _, resp in flat]),
    }
    samples = [
        {
            "step": step,
            "prompt": rec.prompt_text,
            "response": resp.text,  # the policy's own words: what the verifier scored
            "answer": rec.answer,
            "score": sc,
            # tool-integrated rollouts: every turn, the tools' output included
            **({"transcript": resp.turns.transcript} if resp.turns is not None else {}),
        }
        for (rec, resp), sc in list(zip(flat, scores))[: cfg.trainer.log_rollouts]
    ]
    return batch, metrics, samples


def validate(cfg: RunConfig, c: Components, step: int) -> dict:
    """pass@k on the validation sets with the (just synced) engine; collective."""
    metrics, _ = evaluate(c.engine, c.val_sets, val_sampling(cfg), cfg.trainer.val_k, c.scorer, sharded=True, step=step)
    return metrics


def tool_sandbox(cfg: RunConfig) -> tuple[dict | None, dict[str, float]]:
    """The tool sandbox's level and limits on this machine (final.json's ``tool_sandbox``) and the same as the
    first metrics row's numbers (envs/levels.py); ``(None, {})`` for a run without tools."""
    if not cfg.rollout.multi_turn.enabled:
        return None, {}
    from pacs_megatron.envs.levels import start_metrics
    from pacs_megatron.envs.sandbox import Sandbox

    record = Sandbox.from_config(cfg.tools).record()  # the level was checked by preflight; the probe is cached
    return record, start_metrics(record)
