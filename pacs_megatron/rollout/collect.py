"""Generate a step's rollouts across all ranks and give every rank the whole result.

Prompts are split into contiguous shares, one per engine replica (an HF engine per rank; a vLLM
engine per vLLM-TP group), each replica samples ``n`` responses for its share, and the groups are
gathered back in prompt order, so a group's responses are contiguous rows everywhere downstream.
Seeds derive from (step, replica): a resumed run samples exactly what the uninterrupted run did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pacs_megatron.rollout.base import Generator
from pacs_megatron.rollout.types import Response, SamplingParams
from pacs_megatron.utils.dist import map_sharded, rank_and_world, shard_bounds


def replica_coords(engine: Generator) -> tuple[int, int]:
    """(replica index, number of replicas) of this rank's engine; engines spanning several ranks
    (vLLM tensor parallel) expose ``dp_rank`` / ``dp_size``, others are one replica per rank."""
    rank, world = rank_and_world()
    return getattr(engine, "dp_rank", rank), getattr(engine, "dp_size", world)


def step_seed(base_seed: int, step: int, replica: int) -> int:
    """Distinct, reproducible sampling seed of one replica at one step."""
    return (base_seed * 1_000_003 + step * 1_009 + replica) % (2**31 - 1)


def generate_sharded(
    engine: Generator, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, step: int
) -> list[list[Response]]:
    """``sampling.n`` responses per prompt, for all prompts, on every rank.

    MoE routing records (``Response.routed_experts``) are not gathered: they are large (data/routing.py),
    so a response keeps them only on the ranks of the replica that generated it (None elsewhere)."""
    if getattr(engine, "remote", False):  # engines on their own ranks: they shard the same way (rollout/remote.py)
        return engine.generate_step(prompt_ids, sampling, step)
    replica, replicas = replica_coords(engine)
    seeded = replace(sampling, seed=step_seed(sampling.seed or 0, step, replica))
    own: list[list[Response]] = []

    def generate(part):
        own.extend(engine.generate(part, seeded) if part else [])
        return [[replace(r, routed_experts=None) for r in g] for g in own]

    flat = map_sharded(list(prompt_ids), generate, replica, replicas)
    if len(flat) != len(prompt_ids) or any(len(g) != sampling.n for g in flat):
        raise RuntimeError(
            f"engine returned {[len(g) for g in flat]} responses for {len(prompt_ids)} prompts x n={sampling.n}"
        )
    start, _ = shard_bounds(len(prompt_ids), replica, replicas)
    flat[start : start + len(own)] = own
    return flat
