"""Rollouts as padded tensors, and the only ways this project cuts them: by whole prompt groups.

Layout of a :class:`TrainBatch` row b (T = the batch's padded length, fixed for the whole step)::

    input_ids[b]     = [prompt tokens][response tokens][pad ... pad]
    response_mask[b] = [0 ...      0][1 ...        1][0 ...     0]

``token_logp[b, t]`` everywhere in this project is log pi(input_ids[b, t] | input_ids[b, :t]); position
0 has no prediction and holds 0. Right padding needs no attention mask beyond the causal one (a pad
only follows the tokens it could disturb), and a fixed T per step is what makes the old-log-prob and
the training forward see the same shapes (batch-invariant log-probs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from pacs_megatron.pacs.advantage import check_groups


@dataclass(frozen=True)
class TrainBatch:
    """A step's rollouts, rows grouped by prompt (rows ``[k*n, (k+1)*n)`` share prompt k).

    Example:
        >>> b = build_train_batch([[5, 6], [5, 6]], [[7], [8, 9]], [1.0, 0.0], group_size=2, pad_id=0)
        >>> b.input_ids.tolist(), b.response_mask.int().tolist()
        ([[5, 6, 7, 0], [5, 6, 8, 9]], [[0, 0, 1, 0], [0, 0, 1, 1]])
    """

    input_ids: torch.Tensor
    """``[B, T]`` int64 prompt + response + right padding."""
    response_mask: torch.Tensor
    """``[B, T]`` bool, True on response tokens."""
    seq_lens: torch.Tensor
    """``[B]`` int64 prompt + response length (the rest is padding)."""
    scores: torch.Tensor
    """``[B]`` float32 verifiable rewards."""
    group_ids: torch.Tensor
    """``[B]`` int64 prompt index within the step."""
    group_size: int
    """n responses per prompt."""
    old_logp: torch.Tensor | None = None
    """``[B, T]`` float32 log-probs of the rollout policy (filled by the old-log-prob pass)."""
    old_entropy: torch.Tensor | None = None
    """``[B, T]`` float32 entropy of pi_old's predictive distribution at each position (filled with
    ``old_logp``; the step's ``actor/entropy``)."""
    advantages: torch.Tensor | None = None
    """``[B]`` float32 outcome advantages (baselines only), or ``[B, T]`` per-token GAE advantages."""
    rollout_logp: torch.Tensor | None = None
    """``[B, T]`` float32 the engine's log-prob of each sampled token (0 off the response; None when the
    engine gave none): compared with ``old_logp`` every step (pacs/rollout_correction.py)."""
    is_weights: torch.Tensor | None = None
    """Rollout-correction importance weights, ``[B, T]`` per token or ``[B, 1]`` per sequence (None: off)."""
    old_values: torch.Tensor | None = None
    """``[B, T]`` float32 values of the learned critic before its update (``adv_estimator=gae``)."""
    returns: torch.Tensor | None = None
    """``[B, T]`` float32 GAE returns, the critic's regression targets (``adv_estimator=gae``)."""
    routed_experts: torch.Tensor | None = None
    """``[B, T, L, k]`` int64 MoE routing replay (actor.routing_replay=rollout): the experts the rollout
    engine chose for the token at each position, per layer; padding positions hold 0..k-1."""
    ref_logp: torch.Tensor | None = None
    """``[B, T]`` float32 log-probs of the frozen reference policy (algorithm.kl_loss_coef > 0, actor/reference.py)."""

    def __post_init__(self) -> None:
        check_groups(self.input_ids.shape[0], self.group_size, self.group_ids)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows ``[start, stop)``; both must fall on group boundaries."""
        n = self.group_size
        if start % n or stop % n:
            raise ValueError(f"rows {start}:{stop} would split a prompt group of {n}")
        return self._map(lambda t: t[start:stop])

    def take(self, rows: torch.Tensor, length: int | None = None) -> TrainBatch:
        """Rows ``rows`` (whole groups, each contiguous) cut to the first ``length`` columns (default all)."""
        T = self.input_ids.shape[1]
        width = T if length is None else length
        return self._map(lambda t: t[rows, :width] if t.dim() >= 2 and t.shape[1] == T else t[rows])

    def with_(self, **kw) -> TrainBatch:
        return replace(self, **kw)

    def to(self, device: torch.device | str) -> TrainBatch:
        return self._map(lambda t: t.to(device, non_blocking=True))

    def _map(self, fn) -> TrainBatch:
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = fn(v) if isinstance(v, torch.Tensor) else v
        return TrainBatch(**kw)


def build_train_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    scores: Sequence[float],
    group_size: int,
    pad_id: int,
    pad_to_multiple: int = 1,
) -> TrainBatch:
    """Pack per-row prompt/response token lists (row b's prompt is its group's prompt) into a batch."""
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
            mask[b, len(p) : len(p) + len(r)] = True
    return TrainBatch(
        input_ids=ids,
        response_mask=mask,
        seq_lens=torch.as_tensor(lens, dtype=torch.long),
        scores=torch.as_tensor(list(scores), dtype=torch.float32),
        group_ids=torch.arange(B, dtype=torch.long) // group_size,
        group_size=group_size,
    )


def split_micro_batches(batch: TrainBatch, micro_batch_size: int) -> list[TrainBatch]:
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


def split_mini_batches(batch: TrainBatch, mini_batch_prompts: int) -> list[TrainBatch]:
    """Mini-batches (one optimizer step each) of ``mini_batch_prompts`` whole groups."""
    rows = mini_batch_prompts * batch.group_size
    if len(batch) % rows:
        raise ValueError(f"{batch.num_groups} prompts do not split into mini-batches of {mini_batch_prompts}")
    return [batch.rows(s, s + rows) for s in range(0, len(batch), rows)]


def dp_shard(batch: TrainBatch, dp_rank: int, dp_size: int) -> TrainBatch:
    """This data-parallel rank's contiguous share of whole groups."""
    if batch.num_groups % dp_size:
        raise ValueError(f"{batch.num_groups} prompt groups do not split over {dp_size} data-parallel ranks")
    per = len(batch) // dp_size
    return batch.rows(dp_rank * per, (dp_rank + 1) * per)


def response_values(batch: TrainBatch, values: Sequence[Sequence[float] | None]) -> torch.Tensor | None:
    """``[B, T]`` float32 holding row b's per-response-token ``values[b]`` at its response positions (0
    elsewhere), e.g. the engine's sampled-token log-probs; None when any row has none.

    Example:
        >>> b = build_train_batch([[5, 6], [5, 6]], [[7], [8, 9]], [1.0, 0.0], group_size=2, pad_id=0)
        >>> response_values(b, [[-0.5], [-1.0, -2.0]]).tolist()
        [[0.0, 0.0, -0.5, 0.0], [0.0, 0.0, -1.0, -2.0]]
    """
    if any(v is None for v in values):
        return None
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    counts = batch.response_mask.sum(1).tolist()
    for b, (v, k) in enumerate(zip(values, counts)):
        if len(v) != k:
            raise ValueError(f"row {b}: {len(v)} values for {k} response tokens")
    out[batch.response_mask] = torch.tensor([x for v in values for x in v], dtype=torch.float32)
    return out


def routed_experts_tensor(batch: TrainBatch, rows: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """``[B, T, L, k]`` int64 MoE routing replay from each row's recorded ``[len_b, L, k]`` experts
    (rollout Response.routed_experts, prompt + response tokens); padding positions hold 0..k-1 (any
    k distinct experts: the router must get a valid choice, and causality keeps it from mattering).
    None when any row has none."""
    if not rows or any(r is None for r in rows):
        return None
    L, k = rows[0].shape[1:]
    B, T = batch.input_ids.shape
    out = torch.arange(k, dtype=torch.long).expand(B, T, L, k).clone()
    for b, r in enumerate(rows):
        if r.shape[0] != int(batch.seq_lens[b]):
            raise ValueError(f"row {b}: routed experts for {r.shape[0]} tokens, the row has {int(batch.seq_lens[b])}")
        out[b, : r.shape[0]] = r.long()
    return out
