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

Fused LM head (``model.fused_lm_head``, issue 44): within :func:`fused_head_hook` the output layer returns
its (row-selected) input instead of logits, so the chunk's output is the final norm's hidden states
``[b, T, h]`` (``[1, n, h]`` with rows) and the loss function gets a :class:`HeadInput` (those states and
the layer's weight): ops/head.py computes the log-probs chunk by chunk without any ``[n, V]`` logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pacs_megatron.actor.model import output_weight
from pacs_megatron.actor.thd import ThdBatch
from pacs_megatron.actor.weights import unwrap
from pacs_megatron.config.model import AUTO_FUSE_SHARE, ModelConfig
from pacs_megatron.utils.devices import rank_memory_bytes
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

FUSED_HEAD_ATTR = "_pacs_fused_lm_head"
"""Attribute of a model chunk (set by :func:`set_fused_head`) that turns the fused LM head on for it."""


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


@dataclass(frozen=True)
class HeadInput:
    """What a chunk with a bypassed output layer hands its loss function instead of logits.

    Example:
        >>> x = HeadInput(hidden=torch.zeros(2, 5, 8), weight=torch.zeros(32, 8))
        >>> x.hidden.shape[:-1]  # the logits' leading shape: targets are shaped alike
        torch.Size([2, 5])
    """

    hidden: torch.Tensor
    """``[b, T, h]`` final-norm hidden states (``[1, n, h]`` for selected rows or THD), the whole sequence."""
    weight: torch.Tensor
    """``[V/tp, h]`` the output layer's weight (the shared embedding for tied models): model.output_weight."""
    reduce_grad_input: bool = True
    """All-reduce grad_hidden over TP in the op (False under sequence parallelism, whose gather reduce-scatters)."""


UNFUSED_LOGITS_BUFFERS = 1.3
"""Vocabulary-sized buffers a token the unfused head holds forward + backward, in the model's dtype: measured
1.02-1.28 (docs/benchmarks.md, "model.fused_lm_head=auto: where fusing pays"), rounded up."""


def logits_bytes(tokens: int, vocab_local: int, dtype: torch.dtype) -> int:
    """What one micro-batch of ``tokens`` holds for its logits on the unfused path (a TP rank's ``vocab_local``
    columns): the quantity ``model.fused_lm_head=auto`` weighs against the rank's memory.

    Example:
        >>> round(logits_bytes(8192, 49152, torch.float32) / 2**30, 2)
        1.95
    """
    return int(tokens * vocab_local * dtype.itemsize * UNFUSED_LOGITS_BUFFERS)


def choose_fused_head(model: ModelConfig, tokens: int, vocab_local: int, dtype: torch.dtype, device_type: str) -> bool:
    """``model.fused_lm_head`` resolved for a rank whose micro-batches hold up to ``tokens`` tokens (the token
    budget: an upper bound, as training computes the response rows only) over ``vocab_local`` columns; one log
    line says what and why."""
    need, have = logits_bytes(tokens, vocab_local, dtype), rank_memory_bytes(device_type)
    fused = model.use_fused_lm_head(need, have)
    logger.info(
        "LM head %s (model.fused_lm_head=%s): a micro-batch's logits up to %.2f GB, %.1f%% of this rank's %.0f GB%s",
        "fused" if fused else "unfused",
        model.fused_lm_head,
        need / 1e9,
        100 * need / have,
        have / 1e9,
        f" (auto fuses above {AUTO_FUSE_SHARE:.0%})" if model.fused_lm_head == "auto" else "",
    )
    return fused


def set_fused_head(chunks: list, enabled: bool) -> None:
    """Turn the fused LM head on or off for every chunk (chunks without an output layer ignore it)."""
    for chunk in chunks:
        setattr(unwrap(chunk), FUSED_HEAD_ATTR, bool(enabled))


def fuses_head(model) -> bool:
    """Whether ``model`` (a chunk, possibly DDP-wrapped) holds the output layer and has the fused head on."""
    model = unwrap(model)
    return bool(getattr(model, FUSED_HEAD_ATTR, False)) and bool(getattr(model, "post_process", False))


def head_input_loss(loss_func, model):
    """Wrap megatron's ``loss_func`` so that its first argument (the chunk's output, hidden states under
    :func:`fused_head_hook`) arrives as a :class:`HeadInput` carrying the output weight."""
    chunk = unwrap(model)
    sp = bool(chunk.output_layer.sequence_parallel)

    def wrapped(output, *args, **kwargs):
        return loss_func(HeadInput(output, output_weight(chunk), reduce_grad_input=not sp), *args, **kwargs)

    return wrapped


@contextmanager
def fused_head_hook(model, enabled: bool) -> Iterator[None]:
    """Within the block, ``model``'s output layer returns its input (after :func:`logit_rows_hook`'s row
    selection) instead of ``input @ weight.T``: GPTModel then returns the hidden states ``[b, T, h]``.

    Under sequence parallelism the layer's input is this rank's slice of the sequence; it is gathered here
    with megatron's ``gather_from_sequence_parallel_region`` (backward: reduce-scatter), as the layer itself
    would. Sequence parallelism needs Transformer Engine or Apex: that branch was never run (CPU only)."""
    if not enabled:
        yield
        return
    layer = unwrap(model).output_layer

    def skip(input_, weight=None, runtime_gather_output=None):  # noqa: ARG001 - ColumnParallelLinear's signature
        if layer.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            input_ = gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=True, group=layer.tp_group
            )
        return input_, None

    layer.forward = skip  # an instance attribute: nn.Module.__call__ still runs the row-selection pre-hook
    try:
        yield
    finally:
        del layer.forward
