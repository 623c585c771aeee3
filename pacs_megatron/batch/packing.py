"""Padding-free batching: token-budget micro-batches of whole prompt groups, balanced over DP.

1. **DP balance** (:func:`balance_groups`, :func:`dp_balanced_shard`): each global mini-batch's groups go to
   the data-parallel ranks by *tokens*, the same number of groups per rank: largest first in rounds of
   ``dp``, each round's largest to the lightest rank. The spread ``max - min`` of the ranks' tokens stays at
   most the largest group's tokens (induction: pairing the round's items, sorted descending, with the ranks,
   sorted ascending, never widens the spread beyond ``max(spread, largest item)``).
2. **Micro-batches** (:func:`plan_micro_batches`): whole groups, longest first, filled in order until the
   next group would exceed the budget; a micro-batch costs ``rows x padded_len`` (its own longest row rounded
   up to ``multiple``). A group that alone exceeds the budget is an error naming its tokens and the budget.

The plan is a pure function of ``seq_lens``, ``group_size``, the budget and the mini-batch size, so the
old-log-prob and training passes get identical partitions and shapes (batch-invariant log-probs).
Why, invariants and the loss weighting: docs/batching.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from pacs_megatron.batch.rows import Rollouts

R = TypeVar("R", bound=Rollouts)


def padded_len(length: int, multiple: int = 8) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-int(length) // multiple) * multiple


def group_tokens(seq_lens: Sequence[int], group_size: int, multiple: int = 8) -> list[int]:
    """Padded tokens of each group alone: ``n x padded_len(longest row of the group)``.

    Example:
        >>> group_tokens([3, 9, 4, 4], group_size=2)
        [32, 16]
    """
    lens = [int(x) for x in seq_lens]
    if len(lens) % group_size:
        raise ValueError(f"{len(lens)} rows are not whole groups of {group_size}")
    return [group_size * padded_len(max(lens[s : s + group_size]), multiple) for s in range(0, len(lens), group_size)]


def _plan_chunk(lens: list[int], group_size: int, groups: range, max_tokens: int, multiple: int) -> list[list[int]]:
    # longest first; ties by index: deterministic, and each micro-batch's first group sets its length
    order = sorted(groups, key=lambda g: (-max(lens[g * group_size : (g + 1) * group_size]), g))
    plan: list[list[int]] = []
    rows = width = 0
    for g in order:
        glen = padded_len(max(lens[g * group_size : (g + 1) * group_size]), multiple)
        if group_size * glen > max_tokens:
            raise ValueError(
                f"prompt group {g} needs {group_size * glen} tokens ({group_size} rows x {glen} padded) but "
                f"algorithm.max_tokens_per_micro_batch={max_tokens}: raise the budget to at least "
                f"{group_size * glen}, or lower rollout.max_response_length"
            )
        if plan and (rows + group_size) * max(width, glen) <= max_tokens:
            plan[-1].append(g)
            rows, width = rows + group_size, max(width, glen)
        else:
            plan.append([g])
            rows, width = group_size, glen
    return plan


def plan_micro_batches(
    seq_lens: Sequence[int], group_size: int, max_tokens: int, chunk_groups: int = 0, multiple: int = 8
) -> list[list[int]]:
    """Group indices of each micro-batch, under ``max_tokens`` padded tokens per micro-batch.

    ``chunk_groups`` > 0 plans each run of that many consecutive groups (one mini-batch) on its own
    and concatenates the plans, so a micro-batch never mixes mini-batches.

    Example:
        >>> plan_micro_batches([2, 2, 20, 18, 3, 3, 9, 9], group_size=2, max_tokens=64)
        [[1], [3, 2], [0]]
    """
    lens = [int(x) for x in seq_lens]
    num_groups = len(group_tokens(lens, group_size, multiple))
    chunk = chunk_groups or num_groups
    if num_groups % chunk:
        raise ValueError(f"{num_groups} groups do not split into mini-batches of {chunk}")
    plan: list[list[int]] = []
    for start in range(0, num_groups, chunk):
        plan += _plan_chunk(lens, group_size, range(start, start + chunk), max_tokens, multiple)
    return plan


def micro_batch_tokens(seq_lens: Sequence[int], group_size: int, plan: list[list[int]], multiple: int = 8) -> list[int]:
    """Padded tokens (``rows x padded_len``) of each micro-batch of ``plan``."""
    lens = [int(x) for x in seq_lens]
    out = []
    for mb in plan:
        rows = [r for g in mb for r in range(g * group_size, (g + 1) * group_size)]
        out.append(len(rows) * padded_len(max(lens[r] for r in rows), multiple))
    return out


def balance_groups(costs: Sequence[int], num_bins: int) -> list[list[int]]:
    """Split item indices into ``num_bins`` bins of equal count (``len(costs) % num_bins == 0``) with
    balanced cost sums: ``max - min <= max(costs)`` (see the module docstring). Each bin is sorted.

    Example:
        >>> balance_groups([10, 1, 1, 8], 2)
        [[0, 2], [1, 3]]
    """
    if len(costs) % num_bins:
        raise ValueError(f"{len(costs)} groups do not split over {num_bins} data-parallel ranks")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    load = [0] * num_bins
    for start in range(0, len(order), num_bins):
        lightest = sorted(range(num_bins), key=lambda b: (load[b], b))
        for item, b in zip(order[start : start + num_bins], lightest):
            bins[b].append(item)
            load[b] += costs[item]
    return [sorted(b) for b in bins]


def _rows_of(groups: Sequence[int], group_size: int) -> torch.Tensor:
    return torch.tensor([r for g in groups for r in range(g * group_size, (g + 1) * group_size)], dtype=torch.long)


def dp_balanced_shard(batch: R, dp_rank: int, dp_size: int, mini_batch_groups: int, multiple: int = 8) -> R:
    """This DP rank's groups: each global mini-batch of ``mini_batch_groups`` consecutive groups is
    split over the ranks by tokens (:func:`balance_groups`), the rank's shares kept in mini-batch order.
    """
    n = batch.group_size
    costs = group_tokens(batch.seq_lens.tolist(), n, multiple)
    if len(costs) % mini_batch_groups or mini_batch_groups % dp_size:
        raise ValueError(
            f"{len(costs)} groups do not split into mini-batches of {mini_batch_groups} over {dp_size} DP ranks"
        )
    mine: list[int] = []
    for start in range(0, len(costs), mini_batch_groups):
        bins = balance_groups(costs[start : start + mini_batch_groups], dp_size)
        mine += [start + g for g in bins[dp_rank]]
    return batch.take(_rows_of(mine, n))


def pack_micro_batches(
    batch: R, max_tokens: int, chunk_groups: int = 0, same_length: bool = False, multiple: int = 8
) -> tuple[list[R], torch.Tensor]:
    """Micro-batches of ``batch`` under the token budget, each cut to its own padded length (or, with
    ``same_length``, all to the longest of them), and the row index ``[B]``: micro-batch rows,
    concatenated, came from ``batch`` rows ``index``."""
    lens = batch.seq_lens.tolist()
    plan = plan_micro_batches(lens, batch.group_size, max_tokens, chunk_groups, multiple)
    rows = [_rows_of(mb, batch.group_size) for mb in plan]
    widths = [min(padded_len(max(lens[r] for r in idx.tolist()), multiple), batch.input_ids.shape[1]) for idx in rows]
    if same_length:
        widths = [max(widths)] * len(widths)
    micro = [batch.take(idx, width) for idx, width in zip(rows, widths)]
    return micro, torch.cat(rows)


def token_budget(max_tokens_per_micro_batch: int, micro_batch_size: int, max_length: int) -> int:
    """``algorithm.max_tokens_per_micro_batch``, or by default (0) the most a fixed micro-batch can hold:
    ``micro_batch_size x padded(max_length)`` (``data.max_prompt_length + rollout.max_response_length``),
    so no token-budget micro-batch needs more activation memory than fixed batching could.

    Example:
        >>> token_budget(0, 8, 100), token_budget(4096, 8, 100)
        (832, 4096)
    """
    return max_tokens_per_micro_batch or micro_batch_size * padded_len(max_length)
