"""The step's rows, typed by how far they have come: :class:`Rollouts` (sampled and scored),
:class:`TrainRows` (the advantages added, and the reference's log-probs where the run has one), then
:class:`TrainBatch` (ready for a loss: pi_old's log-probs filled). Pure torch, at the
bottom of the package, so every layer may import it; the losses take a :class:`TrainBatch` directly.

Layout of row b (T = the batch's padded length, fixed for the whole step)::

    input_ids[b]     = [prompt tokens][response tokens][pad ... pad]
    response_mask[b] = [0 ...      0][1 ...        1][0 ...     0]

``token_logp[b, t]`` everywhere in this project is log pi(input_ids[b, t] | input_ids[b, :t]); position
0 has no prediction and holds 0. Right padding needs no attention mask beyond the causal one (a pad
only follows the tokens it could disturb), and a fixed T per step is what makes the old-log-prob and
the training forward see the same shapes (batch-invariant log-probs).

Rows are grouped by prompt: rows ``[k*n, (k+1)*n)`` share prompt k, and every cut this project makes
(micro-batches, mini-batches, data-parallel shares, token-budget packs) takes whole groups. A field is
changed with :func:`dataclasses.replace`, which checks its name; a row type becomes the next through
:meth:`TrainRows.of` and :meth:`TrainBatch.of_rows`, which name the fields the step adds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypeVar

import torch

R = TypeVar("R", bound="Rollouts")


def check_groups(num_rows: int, group_size: int, group_ids: torch.Tensor | None = None) -> None:
    """Rows must come in whole, contiguous groups of ``group_size`` (a group split across a
    micro-batch or interleaved with another would silently give wrong baselines)."""
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1 (rollout.n)")
    if num_rows % group_size != 0:
        raise ValueError(
            f"batch of {num_rows} rows is not a whole number of groups of {group_size}: micro-batches "
            "must hold whole prompt groups (make micro_batch_size a multiple of rollout.n)"
        )
    if group_ids is not None:
        ids = group_ids.reshape(-1, group_size)
        if not bool((ids == ids[:, :1]).all()):
            bad = int((ids != ids[:, :1]).any(dim=1).nonzero()[0, 0])
            raise ValueError(
                f"rows {bad * group_size}..{(bad + 1) * group_size - 1} do not share one prompt: the "
                f"{group_size} responses of a prompt must be contiguous rows"
            )
        firsts = ids[:, 0]
        if firsts.numel() != torch.unique(firsts).numel():
            raise ValueError("a prompt's responses appear in two separate blocks: groups must be contiguous")


class RowRecords(Protocol):
    """Per-row records a row selection carries along, kept on the host (data/routing.py's RoutedExperts)."""

    def take(self, rows: torch.Tensor) -> RowRecords: ...


@dataclass(frozen=True, kw_only=True)
class Rollouts:
    """A step's sampled, scored responses as padded tensors (batch/build.py builds them)."""

    input_ids: torch.Tensor
    """``[B, T]`` int64 prompt + response + right padding."""
    response_mask: torch.Tensor
    """``[B, T]`` bool, True on response tokens."""
    seq_lens: torch.Tensor
    """``[B]`` int64 prompt + response length (the rest is padding)."""
    scores: torch.Tensor
    """``[B]`` float32 verifiable rewards (plus any shaping, pacs/overlong.py)."""
    group_ids: torch.Tensor
    """``[B]`` int64 prompt index within the step."""
    group_size: int
    """n responses per prompt."""
    rollout_logp: torch.Tensor | None = None
    """``[B, T]`` float32 the engine's log-prob of each sampled token (0 off the response; None when the
    engine gave none): compared with the old log-probs every step (pacs/rollout_correction.py)."""
    is_weights: torch.Tensor | None = None
    """Per-token ``[B, T]`` or per-row ``[B, 1]`` loss weights: truncated rows at 0
    (``algorithm.overlong.mask_truncated``) times the rollout-correction weights (None: all 1). A unit of
    weight 0 leaves the loss, its mean's denominator and (PACS) its group."""
    routed_experts: RowRecords | None = None
    """MoE routing replay (actor.routing_replay=rollout): per row, the experts the rollout engine chose
    for each token, per layer, unpadded and compact (data/routing.py); the actor pads them per
    micro-batch. Row selections carry them along; ``to(device)`` leaves them on the host."""

    def __post_init__(self) -> None:
        check_groups(self.input_ids.shape[0], self.group_size, self.group_ids)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    def rows(self: R, start: int, stop: int) -> R:
        """Rows ``[start, stop)``; both must fall on group boundaries."""
        n = self.group_size
        if start % n or stop % n:
            raise ValueError(f"rows {start}:{stop} would split a prompt group of {n}")
        return self._map(lambda t: t[start:stop], torch.arange(start, stop))

    def take(self: R, rows: torch.Tensor, length: int | None = None) -> R:
        """Rows ``rows`` (whole groups, each contiguous) cut to the first ``length`` columns (default all)."""
        T = self.input_ids.shape[1]
        width = T if length is None else length
        return self._map(lambda t: t[rows, :width] if t.dim() >= 2 and t.shape[1] == T else t[rows], rows)

    def to(self: R, device: torch.device | str) -> R:
        return self._map(lambda t: t.to(device, non_blocking=True))

    def _map(self: R, fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor | None = None) -> R:
        """``fn`` applied to every tensor field; ``rows``: the row selection ``fn`` makes, applied to
        the per-row records too."""
        kw: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = fn(v)
            elif v is not None and hasattr(v, "take"):  # RowRecords
                v = v if rows is None else v.take(rows)
            kw[f.name] = v
        return type(self)(**kw)


@dataclass(frozen=True, kw_only=True)
class TrainRows(Rollouts):
    """Rollouts with what the step adds before pi_old's log-probs: the advantages (required) and, when the
    run has them, the reference policy's log-probs and the critic's values. The first mini-batch of a step
    trained with ``algorithm.old_logp_from_forward`` goes to the actor as TrainRows: its old log-probs are
    its own training forward's (pi_theta = pi_old there)."""

    advantages: torch.Tensor
    """``[B]`` float32 outcome advantages of the rewards under the loss's estimator (PACS: its
    ``adv_estimator`` of R, the per-row weight of its gradient while psi = 0), or ``[B, T]`` per-token GAE
    advantages from the learned critic."""
    ref_logp: torch.Tensor | None = None
    """``[B, T]`` float32 log-probs of the frozen reference policy (the KL term, PACS v2's anchor)."""
    old_values: torch.Tensor | None = None
    """``[B, T]`` float32 values of the learned critic before its update (``adv_estimator=gae``)."""
    returns: torch.Tensor | None = None
    """``[B, T]`` float32 GAE returns, the critic's regression targets (``adv_estimator=gae``)."""

    @classmethod
    def of(
        cls,
        rollouts: Rollouts,
        *,
        advantages: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
        old_values: torch.Tensor | None = None,
        returns: torch.Tensor | None = None,
    ) -> TrainRows:
        """``rollouts`` with the step's advantages (and reference log-probs, critic values when given)."""
        base = {f.name: getattr(rollouts, f.name) for f in fields(Rollouts)}
        return TrainRows(**base, advantages=advantages, ref_logp=ref_logp, old_values=old_values, returns=returns)


@dataclass(frozen=True, kw_only=True)
class TrainBatch(TrainRows):
    """Rows ready for a loss: pi_old's log-probs and the advantages are required, never a sentinel.

    Example:
        >>> b = loss_batch(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.tensor([1.0, 0.0]), 2)
        >>> len(b), b.num_groups, b.advantages.tolist()
        (2, 1, [0.0, 0.0])
    """

    old_logp: torch.Tensor
    """``[B, T]`` float32 log-probs of the policy before this step's update (pi_old, the proximal policy)."""
    old_entropy: torch.Tensor
    """``[B, T]`` float32 entropy of pi_old's predictive distribution at each position (``actor/entropy``)."""

    @classmethod
    def of_rows(cls, rows: TrainRows, *, old_logp: torch.Tensor, old_entropy: torch.Tensor) -> TrainBatch:
        """``rows`` with pi_old's log-probs and entropy (a TrainBatch's are replaced)."""
        base = {f.name: getattr(rows, f.name) for f in fields(TrainRows)}
        return TrainBatch(**base, old_logp=old_logp, old_entropy=old_entropy)


def loss_batch(
    old_logp: torch.Tensor,
    response_mask: torch.Tensor,
    scores: torch.Tensor,
    group_size: int,
    **fields_: Any,
) -> TrainBatch:
    """A TrainBatch from a loss's tensors alone (token ids 0, whole rows long, groups in order, advantages
    0 unless given): what a loss's unit test or a custom loss's example needs, nothing the model reads."""
    B, T = response_mask.shape
    return TrainBatch(
        input_ids=torch.zeros(B, T, dtype=torch.long),
        response_mask=response_mask.bool(),
        seq_lens=torch.full((B,), T, dtype=torch.long),
        scores=scores,
        group_ids=torch.arange(B, dtype=torch.long) // group_size,
        group_size=group_size,
        old_logp=old_logp,
        old_entropy=fields_.pop("old_entropy", torch.zeros(B, T)),
        advantages=fields_.pop("advantages", torch.zeros(B)),
        **fields_,
    )


def as_train_batch(rows: Rollouts, old_logp: torch.Tensor, **step_fields: Any) -> TrainBatch:
    """``rows`` as a TrainBatch for code outside the step's stages (benchmarks, tests, tools) that brings
    its own old log-probs: ``step_fields`` names any other TrainBatch field; the advantages are ``rows``'
    own (TrainRows) or 0, the entropy 0, unless given."""
    kw = {f.name: getattr(rows, f.name) for f in fields(rows)}
    kw.setdefault("advantages", torch.zeros(len(rows)))
    kw |= {"old_logp": old_logp, "old_entropy": torch.zeros_like(old_logp)} | step_fields
    return TrainBatch(**kw)
