"""Logit rows: the LM head runs only on the positions whose next-token log-prob a pass reads.

``token_logp[:, t]`` comes from the logits at position t-1 (actor/forward.py). The RL loss, its metrics,
the old log-probs, the KL reference and the rollout mismatch read response tokens only
(``batch.response_mask``), and most of a step's tokens are prompt tokens (~73 % in bench/rl_step.py);
the LM head is ~21 % of SmolLM2-135M's matmul FLOPs and its ``[tokens, V]`` logits are the largest
buffers of the step. On the last pipeline stage the hidden states entering megatron's ``output_layer``
are therefore cut to the rows t-1 of every response token t (TRL's ``logits_to_keep`` does the same):

    hidden [T, b, h] (padded) or [N, 1, h] (THD, actor/thd.py) --select--> [n, 1, h] --output_layer-->
        [n, 1, V/tp] --GPTModel transposes--> logits [1, n, V/tp] --log-prob op (targets)--> [1, n]
        --scatter--> token_logp [b, T] (0 at every position not computed)

The old-log-prob pass and the training forward select the same rows, so their LM-head GEMMs have the
same shapes (bit-identical log-probs). Not applied where the output layer gathers the sequence itself
(sequence parallelism: its input is this TP rank's slice of the sequence) nor on chunks without an
output layer (earlier pipeline stages, earlier virtual chunks). Passes that read prompt tokens (the
weight-sync probe, tools/parity.py, HF comparisons) keep full logits: ``response_only=False``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pacs_megatron.actor.thd import ThdBatch
from pacs_megatron.actor.weights import unwrap


@dataclass(frozen=True)
class LogitRows:
    """The positions of one micro-batch whose logits are computed (those predicting a response token).

    Example:
        >>> r = response_rows(torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]]))
        >>> r.index.tolist(), r.targets(torch.arange(8).view(2, 4)).tolist()
        ([2, 4, 1], [[2, 3, 5]])
        >>> r.scatter(torch.tensor([[-1.0, -2.0, -3.0]])).tolist()
        [[0.0, 0.0, -1.0, -2.0], [0.0, -3.0, 0.0, 0.0]]
    """

    index: torch.Tensor
    """``[n]`` row of the output layer's input flattened to ``[S * b, h]`` (padded: ``(t-1) * b + row``;
    THD: the packed position of token t-1)."""
    rows: torch.Tensor
    """``[n]`` padded-layout row of each predicted token."""
    cols: torch.Tensor
    """``[n]`` padded-layout column t (>= 1) of each predicted token."""
    shape: tuple[int, int]
    """``(b, T)`` of the padded micro-batch."""

    def select(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[S, b, h]`` hidden states -> ``[n, 1, h]``, the output layer's input (differentiable)."""
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.index).unsqueeze(1)

    def targets(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[1, n]`` the token each selected position predicts, from the padded ``[b, T]`` ids."""
        return input_ids[self.rows, self.cols].unsqueeze(0)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``[1, n]`` per-row results -> ``[b, T]`` at the predicted tokens' columns, 0 elsewhere
        (differentiable)."""
        return values.new_zeros(self.shape).index_put((self.rows, self.cols), values[0])


def response_rows(response_mask: torch.Tensor, thd: ThdBatch | None = None) -> LogitRows | None:
    """The rows predicting the response tokens of ``response_mask [b, T]`` (on its device), in the
    padded layout or packed as ``thd``; None when the micro-batch has none (then full logits)."""
    b, T = response_mask.shape
    mask = response_mask.bool().clone()
    mask[:, 0] = False  # column 0 is predicted by nothing
    rows, cols = mask.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return None
    if thd is None:
        index = (cols - 1) * b + rows  # the output layer's input is [T, b, h]
    else:
        index = thd.cu_seqlens.to(rows.device)[rows].long() + cols - 1
    return LogitRows(index=index, rows=rows, cols=cols, shape=(b, T))


def selects_rows(model) -> bool:
    """Whether ``model`` (a chunk, possibly DDP-wrapped) computes logits whose rows can be selected:
    it holds the output layer and that layer's input is the whole sequence (no sequence parallelism)."""
    model = unwrap(model)
    layer = getattr(model, "output_layer", None)
    return bool(getattr(model, "post_process", False)) and layer is not None and not layer.sequence_parallel


@contextmanager
def logit_rows_hook(model, rows: LogitRows | None) -> Iterator[None]:
    """Within the block, ``model``'s output layer computes only ``rows`` (no-op for None). A forward
    pre-hook replaces the hidden-state argument only: a tied head's ``weight=`` keyword passes through."""
    if rows is None:
        yield
        return
    handle = unwrap(model).output_layer.register_forward_pre_hook(lambda _m, args: (rows.select(args[0]), *args[1:]))
    try:
        yield
    finally:
        handle.remove()
