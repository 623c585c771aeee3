"""The supervised format warm-up before RL (``trainer.sft_warmup_steps``): the CPU recipe's answer format."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

from pacs_megatron.config import RunConfig
from pacs_megatron.data.batching import TrainBatch, TrainRows, build_rollouts, dp_shard

if TYPE_CHECKING:
    from pacs_megatron.loop.runtime import Components, Runtime


def format_warmup(cfg: RunConfig, rt: Runtime, c: Components) -> dict:
    """Supervised warm-up on (prompt, random digits + eos): teaches the answer *format*, never the
    answer nor its length (targets are drawn uniformly), so the RL run still starts at chance level.
    Prompts are drawn with their own RNG, so the RL prompt stream is untouched."""
    from pacs_megatron.data.synthetic import format_warmup_examples

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
        zeros = torch.zeros(shard.input_ids.shape)  # the sft loss reads no old log-probs and no advantages
        local = TrainBatch.of_rows(TrainRows.of(shard, advantages=zeros[:, 0]), old_logp=zeros, old_entropy=zeros)
        last = c.actor.train_step(local, loss_name="sft")
    return last
