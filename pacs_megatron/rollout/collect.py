"""Generate a step's rollouts across all ranks and give every rank the whole result.

Prompts are split into contiguous shares, one per engine replica (an HF engine per rank; a vLLM
engine per vLLM-TP group), each replica samples ``n`` responses for its share, and the groups are
gathered back in prompt order, so a group's responses are contiguous rows everywhere downstream.
Seeds derive from (step, replica): a resumed run samples exactly what the uninterrupted run did.
Engines on their own ranks shard the same way themselves (rollout/remote/engines.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pacs_megatron.rollout.base import Generator
from pacs_megatron.rollout.types import Response, SamplingParams
from pacs_megatron.utils.dist import map_sharded, shard_bounds


def step_seed(base_seed: int, step: int, replica: int) -> int:
    """Distinct, reproducible sampling seed of one replica at one step."""
    return (base_seed * 1_000_003 + step * 1_009 + replica) % (2**31 - 1)


def generate_sharded(
    engine: Generator, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, step: int
) -> list[list[Response]]:
    """``sampling.n`` responses per prompt, for all prompts, on every rank, from an engine in the trainer's
    processes: its replica (``engine.traits()``) generates its share, the shares are gathered.

    MoE routing records (``Response.routed_experts``) are not gathered: they are large (data/routing.py),
    so a response keeps them only on the ranks of the replica that generated it (None elsewhere)."""
    traits = engine.traits()
    replica, replicas = traits.replica, traits.replicas
    seeded = replace(sampling, seed=step_seed(sampling.seed or 0, step, replica))
    own: list[list[Response]] = []

    def generate(part: Sequence[Sequence[int]]) -> list[list[Response]]:
        own.extend(engine.generate(part, seeded) if part else [])
        return [[replace(r, routed_experts=None) for r in g] for g in own]

    flat: list[list[Response]] = map_sharded(list(prompt_ids), generate, replica, replicas)
    if len(flat) != len(prompt_ids) or any(len(g) != sampling.n for g in flat):
        raise RuntimeError(
            f"engine returned {[len(g) for g in flat]} responses for {len(prompt_ids)} prompts x n={sampling.n}"
        )
    start, _ = shard_bounds(len(prompt_ids), replica, replicas)
    flat[start : start + len(own)] = own
    return flat


class ShardedSteps:
    """``Generator.generate_step`` of the engines in the trainer's processes (HF, vLLM, the multi-turn turn
    loop): :func:`generate_sharded` over the engine's own ``generate`` and ``traits``."""

    def generate_step(
        self: Generator, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, step: int
    ) -> list[list[Response]]:
        """Collective: ``sampling.n`` responses per prompt, for all prompts, on every rank."""
        return generate_sharded(self, prompt_ids, sampling, step)
