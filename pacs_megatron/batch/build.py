"""Rollouts as padded tensors, and the only ways this project cuts them: by whole prompt groups.

The row types and the padded layout are batch/rows.py's; this module builds them from token lists and cuts
them (micro-batches, mini-batches, data-parallel shares; token-budget packs: batch/packing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from pacs_megatron.batch.rows import Rollouts

R = TypeVar("R", bound=Rollouts)


def build_rollouts(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    scores: Sequence[float],
    group_size: int,
    pad_id: int,
    pad_to_multiple: int = 1,
    policy_masks: Sequence[Sequence[bool] | None] | None = None,
) -> Rollouts:
    """Pack per-row prompt/response token lists (row b's prompt is its group's prompt) into padded rows.

    ``policy_masks[b]`` (multi-turn rollouts, ``Response.policy_mask``) marks which response tokens the policy
    sampled: the others (tool output) stay in ``input_ids``, read by every forward, but off ``response_mask``,
    so no loss, log-prob sum, entropy or KL counts them. None (or a None entry): all of them.

    Example:
        >>> b = build_rollouts([[5, 6], [5, 6]], [[7], [8, 9]], [1.0, 0.0], group_size=2, pad_id=0)
        >>> b.input_ids.tolist(), b.response_mask.int().tolist()
        ([[5, 6, 7, 0], [5, 6, 8, 9]], [[0, 0, 1, 0], [0, 0, 1, 1]])
    """
    if not (len(prompt_ids) == len(response_ids) == len(scores)):
        raise ValueError(f"{len(prompt_ids)} prompts, {len(response_ids)} responses, {len(scores)} scores")
    lens = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    T = max(lens)
    T = -(-T // pad_to_multiple) * pad_to_multiple
    B = len(lens)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        if len(r):
            ids[b, len(p) : len(p) + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            policy = policy_masks[b] if policy_masks is not None else None
            if policy is not None and len(policy) != len(r):
                raise ValueError(f"row {b}: a policy mask of {len(policy)} for {len(r)} response tokens")
            mask[b, len(p) : len(p) + len(r)] = True if policy is None else torch.as_tensor(list(policy))
    return Rollouts(
        input_ids=ids,
        response_mask=mask,
        seq_lens=torch.as_tensor(lens, dtype=torch.long),
        scores=torch.as_tensor(list(scores), dtype=torch.float32),
        group_ids=torch.arange(B, dtype=torch.long) // group_size,
        group_size=group_size,
    )


def split_micro_batches(batch: R, micro_batch_size: int) -> list[R]:
    """Consecutive micro-batches of ``micro_batch_size`` rows, never splitting a group."""
    if micro_batch_size % batch.group_size:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} would split a prompt group of {batch.group_size}: "
            "use a multiple of rollout.n"
        )
    if len(batch) % micro_batch_size:
        raise ValueError(
            f"the batch has {len(batch)} rows, not a multiple of micro_batch_size={micro_batch_size}: every "
            "micro-batch of a pass must have the same size (pipeline buffers are shaped from it)"
        )
    return [batch.rows(s, s + micro_batch_size) for s in range(0, len(batch), micro_batch_size)]


def split_mini_batches(batch: R, mini_batch_prompts: int) -> list[R]:
    """Mini-batches (one optimizer step each) of ``mini_batch_prompts`` whole groups."""
    rows = mini_batch_prompts * batch.group_size
    if len(batch) % rows:
        raise ValueError(f"{batch.num_groups} prompts do not split into mini-batches of {mini_batch_prompts}")
    return [batch.rows(s, s + rows) for s in range(0, len(batch), rows)]


def dp_shard(batch: R, dp_rank: int, dp_size: int) -> R:
    """This data-parallel rank's contiguous share of whole groups."""
    if batch.num_groups % dp_size:
        raise ValueError(f"{batch.num_groups} prompt groups do not split over {dp_size} data-parallel ranks")
    per = len(batch) // dp_size
    return batch.rows(dp_rank * per, (dp_rank + 1) * per)


def response_values(batch: Rollouts, values: Sequence[Sequence[float] | None]) -> torch.Tensor | None:
    """``[B, T]`` float32 holding row b's per-response-token ``values[b]`` at its response positions (0
    elsewhere), e.g. the engine's sampled-token log-probs; None when any row has none.

    Example:
        >>> b = build_rollouts([[5, 6], [5, 6]], [[7], [8, 9]], [1.0, 0.0], group_size=2, pad_id=0)
        >>> response_values(b, [[-0.5], [-1.0, -2.0]]).tolist()
        [[0.0, 0.0, -0.5, 0.0], [0.0, 0.0, -1.0, -2.0]]
    """
    given = [v for v in values if v is not None]
    if len(given) < len(values):
        return None
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    counts = batch.response_mask.sum(1).tolist()
    for b, (v, k) in enumerate(zip(given, counts)):
        if len(v) != k:
            raise ValueError(f"row {b}: {len(v)} values for {k} response tokens")
    out[batch.response_mask] = torch.tensor([x for v in given for x in v], dtype=torch.float32)
    return out
