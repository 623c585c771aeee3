"""The supervised format warm-up before RL (``trainer.sft_warmup_steps``): the CPU recipe's answer format."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

from pacs_megatron.config import RunConfig
from pacs_megatron.data.batching import Rollouts, TrainBatch, TrainRows, build_rollouts, dp_shard

TOOL_DEMOS = 8
"""Tool-call demonstrations of the tool warm-up ("a handful": the syntax, not the task)."""

if TYPE_CHECKING:
    from pacs_megatron.loop.runtime import Components, Runtime


def format_warmup(cfg: RunConfig, rt: Runtime, c: Components) -> dict:
    """Supervised warm-up on (prompt, random digits + eos): teaches the answer *format*, never the
    answer nor its length (targets are drawn uniformly), so the RL run still starts at chance level.
    Prompts are drawn with their own RNG, so the RL prompt stream is untouched. With tool-integrated
    rollouts: :func:`tool_warmup`."""
    from pacs_megatron.data.synthetic import format_warmup_examples

    if cfg.rollout.multi_turn.enabled:
        return tool_warmup(cfg, rt, c)

    rng = random.Random(cfg.trainer.seed)
    rows = cfg.mini_batch_prompts * cfg.rollout.n
    last: dict = {}
    lengths = [len(r.answer) for r in c.dataset.records]
    for _ in range(cfg.trainer.sft_warmup_steps):
        picked = [rng.choice(c.dataset.records) for _ in range(rows)]
        pairs = format_warmup_examples(picked, rng, max(lengths), min(lengths))
        shard = dp_shard(
            build_rollouts([p for p, _ in pairs], [t for _, t in pairs], [0.0] * rows, 1, c.pad_id, 8),
            rt.groups.dp_rank,
            rt.groups.dp_size,
        )
        last = _sft_step(c, shard)
    return last


def _sft_step(c: Components, shard: Rollouts) -> dict:
    """One supervised optimizer step; its metrics, with the train step's ``actor/max_abs_logratio`` named for what
    it is here: ``sft/max_token_nll``. The old log-probs given are zeros, so ``max |logp - old|`` over response
    tokens is the largest NLL of one demonstration token (8.3 nats: a token at p ~ 2.6e-4, what the issue's bf16
    warm-up left, against 1.7 in fp32), not a policy ratio."""
    zeros = torch.zeros(shard.input_ids.shape)  # the sft loss reads no old log-probs and no advantages
    local = TrainBatch.of_rows(TrainRows.of(shard, advantages=zeros[:, 0]), old_logp=zeros, old_entropy=zeros)
    metrics = c.actor.train_step(local, loss_name="sft")
    if "actor/max_abs_logratio" in metrics:
        metrics["sft/max_token_nll"] = metrics.pop("actor/max_abs_logratio")
    return metrics


def tool_warmup(cfg: RunConfig, rt: Runtime, c: Components) -> dict:
    """Supervised warm-up on :data:`TOOL_DEMOS` tool-call demonstrations (rollout/multi_turn.py
    ``tool_demonstration``): the call syntax and reading the tool's answer. Each step is one optimizer step on
    the handful of demonstrations; their tool turns are context (off the loss), so the policy is
    never trained to write a problem's answer except by copying it from the tool's output in front of it."""
    from pacs_megatron.rollout.multi_turn import MultiTurnEngine, tool_demonstration

    if not isinstance(c.engine, MultiTurnEngine):  # the separate placement's turn loop runs in the engine processes
        raise ValueError("the tool warm-up needs the turn loop in the trainer (rollout.placement=colocated)")
    rng = random.Random(cfg.trainer.seed)
    records = rng.sample(c.dataset.records, min(TOOL_DEMOS, len(c.dataset.records)))
    demos = [tool_demonstration(c.engine, rec) for rec in records]
    # each demonstration once (repeated only to split over DP): copies would add compute, not signal, since a
    # step's loss is a mean (8 copies of 8 demonstrations: SmolLM2 ~2 min a warm-up step on 2 cores, now ~15 s)
    dp = rt.groups.dp_size
    rows = -(-len(demos) // dp) * dp
    picked = [demos[i % len(demos)] for i in range(rows)]
    batch = build_rollouts(
        [d[0] for d in picked],
        [d[1] for d in picked],
        [0.0] * rows,
        1,
        c.pad_id,
        8,
        policy_masks=[d[2] for d in picked],
    )
    last: dict = {}
    for _ in range(cfg.trainer.sft_warmup_steps):
        last = _sft_step(c, dp_shard(batch, rt.groups.dp_rank, rt.groups.dp_size))
    return last
