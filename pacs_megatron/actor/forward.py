"""One pass of megatron's pipeline schedule over micro-batches of rows (batch/rows.py).

    micro-batches (whole groups, one T) --forward_step--> GPTModel chunk(s) --last stage-->
    vocab-parallel logits [b, T, V/tp] --token_logprobs--> token_logp [b, T] --loss_func--> ...

With the fused LM head on (``model.fused_lm_head``, actor/logit_rows.py ``set_fused_head``) the last stage
skips the output layer: ``hidden [b, T, h] + output weight --token_logprobs (ops/head.py)--> token_logp``,
no ``[b, T, V/tp]`` logits in forward or backward.

``get_forward_backward_func`` picks no-pipelining, 1F1B or interleaved 1F1B (vpp > 1) from the
layout. With fixed batching every micro-batch of a pass has the same T (``seq_length``) and row
count (``micro_batch_size``), which shape the p2p buffers between stages. Token-budget micro-batches
(batch/packing.py) differ in both: megatron's ``variable_seq_lengths`` then sends each activation's
shape ahead of it. Log-probs are batch-invariant on CPU because the old-log-prob pass and the
training pass run the same micro-batches with the same shapes.

Input convention (batch/build.py): right-padded rows, positions 0..T-1, causal mask only;
``token_logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` and ``token_logp[:, 0] = 0``.

Context parallelism (``groups.cp_size`` > 1): rows (THD: each row's segment) are padded to a multiple of
2 * cp and each CP rank runs the model on its zig-zag chunks (parallel/cp_split.py); its per-token log-probs
are all-gathered over the CP group (parallel/cp_comm.py), so every loss and sum downstream reads whole rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from pacs_megatron.actor.logit_rows import (
    HeadInput,
    LogitRows,
    fused_head_hook,
    fuses_head,
    head_input_loss,
    logit_rows_hook,
    response_rows,
    selects_rows,
)
from pacs_megatron.actor.model import mask_padded_vocab
from pacs_megatron.actor.moe.routing import padding_mask, set_routing_replay
from pacs_megatron.actor.thd import ThdBatch, pack_thd
from pacs_megatron.batch.build import split_micro_batches
from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.hf.spec import ModelSpec
from pacs_megatron.ops import fused_head_logprobs, fused_logprobs
from pacs_megatron.parallel import ParallelGroups
from pacs_megatron.parallel.cp_comm import gather_replicated
from pacs_megatron.parallel.cp_split import pad_to_split, padded_length, split_sequence, unsplit_sequence

IGNORE_ID = -100
"""Target id of the last position in the log-prob call: outside [0, V), so logp 0 and no gradient."""


def token_logprobs(
    logits: torch.Tensor | HeadInput,
    input_ids: torch.Tensor,
    spec: ModelSpec,
    groups: ParallelGroups,
    temperature: float,
    with_entropy: bool = False,
    inplace_backward: bool = False,
    thd: ThdBatch | None = None,
    rows: LogitRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logp [b, T]`` float32 (and ``entropy [b, T]``) from this rank's logits ``[b, T, V/tp]``, or
    from THD-packed logits ``[1, N, V/tp]`` of ``thd`` (actor/thd.py: targets and results follow the packing),
    or from the logits ``[1, n, V/tp]`` of the selected ``rows`` only (actor/logit_rows.py; 0 elsewhere).

    The op is called with ``mask=None`` in every pass: with full logits token_logp covers prompt tokens
    too (the weight-sync probe compares them), and the old-log-prob pass and the training forward must
    run the identical computation (batch invariance). Masked sums are taken by the callers.

    The op gets the FULL logits with the targets shifted by one and the last target set to
    :data:`IGNORE_ID` (not ``logits[:, :-1]``): autograd would otherwise build a zeros + copy gradient
    of the whole logits buffer for the slice. With ``inplace_backward`` (the training pass) the op
    writes d loss / d logits into the logits buffer itself, so no N x V gradient is allocated; the
    logits must then have no other reader in backward (here: none, they are the loss' only input).

    A :class:`HeadInput` (the fused LM head: hidden states and the output weight instead of logits) takes
    the same targets through ops/head.py, which masks the padded vocab itself and holds one logits block
    at a time (``inplace_backward`` is moot there: no logits gradient exists).

    Under context parallelism the logits (or hidden states) are this CP rank's chunks of the rows
    padded by :func:`cp_inputs`; the results are gathered over the CP group into whole rows, whose
    backward reaches this rank's chunks only (every CP rank computes the same loss from them).
    """
    cp = groups.cp_size
    if cp > 1 and rows is not None:
        raise ValueError("parallel.cp > 1 computes the logits of every token of a rank's chunks (no logit rows)")
    if not isinstance(logits, HeadInput):
        logits = mask_padded_vocab(logits, spec, groups, inplace=inplace_backward)
    if rows is not None:
        targets = rows.targets(input_ids)
    elif thd is None:
        targets = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_ID)
        if cp > 1:  # the targets of this rank's positions (the next token of each, from the whole row)
            targets = split_sequence(pad_to_split(targets, cp, IGNORE_ID), cp, groups.cp_rank)
    else:
        targets = thd.next_token_targets(IGNORE_ID)
        if cp > 1:
            targets = targets[:, thd.cp_local_index(groups.cp_rank).to(targets.device)]
    if isinstance(logits, HeadInput):
        rec = fused_head_logprobs(
            logits.hidden,
            logits.weight,
            targets,
            temperature=temperature,
            tp_group=groups.tp_group,
            return_entropy=with_entropy,
            vocab_size=spec.vocab_size,
            reduce_grad_input=logits.reduce_grad_input,
        )
    else:
        rec = fused_logprobs(
            logits,
            targets,
            mask=None,
            temperature=temperature,
            tp_group=groups.tp_group,
            return_entropy=with_entropy,
            inplace_backward=inplace_backward,
        )
    if rows is not None or thd is not None:

        def unpack(x: torch.Tensor) -> torch.Tensor:
            if rows is not None:
                return rows.scatter(x.float())
            if cp > 1:
                x = thd.cp_unsplit(gather_replicated(x.float(), groups.cp_group, dim=1))
            return thd.unpack_predictions(x.float())

        return unpack(rec.token_logp), (unpack(rec.entropy) if with_entropy else None)
    T = input_ids.shape[1]

    def whole(x: torch.Tensor) -> torch.Tensor:  # [b, T(/cp)] predictions -> [b, T] in sequence order
        x = x.float()
        if cp > 1:
            x = unsplit_sequence(gather_replicated(x, groups.cp_group, dim=1), cp)
        return F.pad(x[:, : T - 1], (1, 0))

    return whole(rec.token_logp), (whole(rec.entropy) if with_entropy else None)


def cp_inputs(ids: torch.Tensor, groups: ParallelGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids)`` this rank runs the model on: the whole ``[b, T]`` rows without context
    parallelism, else the rows padded to a multiple of 2 * cp and cut to this CP rank's chunks."""
    cp, rank = groups.cp_size, groups.cp_rank
    ids = pad_to_split(ids, cp) if cp > 1 else ids
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    return split_sequence(ids, cp, rank), split_sequence(positions, cp, rank)


LossFactory = Callable[..., Callable]
"""``make_loss_func(micro_batch, input_ids_on_device, dummy[, thd=ThdBatch][, rows=LogitRows])`` -> megatron's
``loss_func``."""


def interleave_padding(num_micro: int, groups: ParallelGroups) -> int:
    """Extra micro-batches the interleaved schedule (vpp > 1) needs: megatron-core 0.16.1 runs
    micro-batches in groups of pp and rejects fewer than pp, or a last group of 0 < size < pp."""
    if groups.vpp_size == 1 or groups.pp_size == 1:
        return 0
    return -num_micro % groups.pp_size


def run_schedule(
    chunks: list,
    micro: Sequence[Rollouts],
    make_loss_func: LossFactory,
    groups: ParallelGroups,
    forward_only: bool,
    thd: bool = False,
    response_only: bool = False,
) -> list:
    """Run megatron's schedule over ``micro``; returns what the loss functions reported, one entry
    per micro-batch on the last pipeline stage (empty elsewhere).

    ``make_loss_func(micro_batch, input_ids_on_device, dummy)`` returns megatron's ``loss_func`` (with
    ``thd``, also ``thd=`` the micro-batch's :class:`ThdBatch`: the logits come packed). In
    ``forward_only`` mode it is called with ``non_loss_data=True`` and returns a dict of tensors.
    With vpp > 1, repeats of the last micro-batch pad the pass (:func:`interleave_padding`); their
    loss functions get ``dummy=True`` and must contribute nothing (a zero loss and a zero count),
    and their outputs are dropped. ``thd``: run the layers on THD-packed rows (actor/thd.py).
    ``response_only``: the LM head computes only the logits of response tokens, where it can
    (actor/logit_rows.py); the loss function then gets ``rows=`` the :class:`LogitRows` its logits hold.
    Chunks with the fused LM head on (``set_fused_head``) hand their loss function a :class:`HeadInput`
    (hidden states and the output weight) instead of logits.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n_real = len(micro)
    micro = list(micro) + [micro[-1]] * interleave_padding(n_real, groups)
    mbs, T = micro[0].input_ids.shape
    if groups.cp_size > 1:
        T = padded_length(T, groups.cp_size)  # the schedule's p2p shapes divide it by cp
    device = groups.device

    def forward_step(data_iterator, model):
        k, mb = next(data_iterator)
        ids = mb.input_ids.to(device, non_blocking=True)
        p = pack_thd(ids, mb.seq_lens, 8 * groups.tp_size * groups.cp_size, groups.cp_size) if thd else None
        # MoE (actor/moe/routing.py): the recorded experts in the routers' token order; None: route anew
        routed = None if mb.routed_experts is None else mb.routed_experts.padded(ids.shape[1])
        set_routing_replay(model, routed, ids.shape[1], p, groups.tp_rank, groups.tp_size)
        mask = _moe_padding_mask(model, mb, ids.shape[1], p, k >= n_real, groups)
        # under CP the LM head's input is this rank's chunks: the logit rows are not selected there
        select = response_only and groups.cp_size == 1 and selects_rows(model)
        rows = response_rows(mb.response_mask.to(device), p) if select else None
        extra = {"thd": p} if p is not None else {}
        if rows is not None:
            extra["rows"] = rows
        fused = fuses_head(model)
        with logit_rows_hook(model, rows), fused_head_hook(model, fused):
            if p is not None:  # CPU: actor/attention.py; GPU (TE): written, never run (actor/thd.py)
                local = p.cp_local_index(groups.cp_rank)
                out = model(
                    input_ids=p.input_ids[:, local],
                    position_ids=p.position_ids[:, local],
                    attention_mask=None,
                    packed_seq_params=p.packed_seq_params(),
                    padding_mask=mask,
                )
            else:  # token-budget micro-batches (batch/packing.py) differ in rows and length: positions per micro-batch
                model_ids, positions = cp_inputs(ids, groups)
                out = model(input_ids=model_ids, position_ids=positions, attention_mask=None, padding_mask=mask)
        loss_func = make_loss_func(mb, ids, k >= n_real, **extra)
        return out, head_input_loss(loss_func, model) if fused else loss_func

    iters = [iter(enumerate(micro)) for _ in chunks]
    kwargs = {}
    if groups.pp_size > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        config = _unwrap(chunks[0]).config
        # Shapes that vary between micro-batches: megatron then sends each activation's shape ahead of it.
        config.variable_seq_lengths = thd or len({m.input_ids.shape for m in micro}) > 1
        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=groups.pp_group, config=config)
    fb = get_forward_backward_func(pp_size=groups.pp_size, vp_size=groups.vpp_size if groups.vpp_size > 1 else None)
    store = fb(
        forward_step_func=forward_step,
        data_iterator=iters if len(chunks) > 1 else iters[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro),
        seq_length=T,
        micro_batch_size=mbs,
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
        pg_collection=groups.pg_collection,
        **kwargs,
    )
    return store[:n_real]


def logprob_loss_func(
    mb: Rollouts,
    ids: torch.Tensor,
    dummy: bool,  # noqa: ARG001 - padding outputs are dropped by run_schedule
    spec: ModelSpec,
    groups: ParallelGroups,
    temperature: float,
    with_entropy: bool,
    thd: ThdBatch | None = None,
    rows: LogitRows | None = None,
):
    """loss_func of the forward-only pass: collect ``token_logp`` (and ``entropy``) on the last stage."""

    def loss_func(logits, non_loss_data=False):  # noqa: ARG001 - megatron's signature
        token_logp, entropy = token_logprobs(logits, ids, spec, groups, temperature, with_entropy, thd=thd, rows=rows)
        out = {"token_logp": token_logp}
        if entropy is not None:
            out["entropy"] = entropy
        return out

    return loss_func


def forward_logprobs(
    chunks: list,
    batch: Rollouts,
    micro_batch_size: int,
    spec: ModelSpec,
    groups: ParallelGroups,
    temperature: float,
    with_entropy: bool,
    packed: tuple[Sequence[Rollouts], torch.Tensor] | None = None,
    thd: bool = False,
    response_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No-grad log-probs of ``batch`` ``[B, T]`` (+ entropy) on every rank of this pipeline (CPU tensors).

    ``packed``: token-budget micro-batches and their source rows (batch/packing.py pack_micro_batches)
    instead of consecutive ``micro_batch_size`` rows; columns past a micro-batch's length hold 0.
    ``response_only``: only response tokens' values are computed, 0 elsewhere (actor/logit_rows.py).
    """
    B, T = batch.input_ids.shape
    micro, rows = packed or (split_micro_batches(batch, min(micro_batch_size, B)), torch.arange(B))
    make = partial(logprob_loss_func, spec=spec, groups=groups, temperature=temperature, with_entropy=with_entropy)
    with torch.no_grad():
        store = run_schedule(chunks, micro, make, groups, forward_only=True, thd=thd, response_only=response_only)
    keys = ("token_logp", "entropy") if with_entropy else ("token_logp",)
    out = gather_rows(micro, rows, store, keys, (B, T), groups)
    return out[0], (out[1] if with_entropy else None)


def gather_rows(
    micro: Sequence[Rollouts],
    rows: torch.Tensor,
    store: list[dict],
    keys: tuple[str, ...],
    shape: tuple[int, int],
    groups: ParallelGroups,
) -> torch.Tensor:
    """``[len(keys), B, T]`` float32 CPU: each key's per-micro-batch ``[b, t]`` tensors of ``store`` (the
    last stage's loss-function outputs) put back at their source ``rows`` (micro-batch i holds rows
    ``rows[sum(len(micro[:i])) : ...]``), on every rank of the pipeline; columns past a micro-batch's
    length hold 0."""
    buf = torch.zeros((len(keys), *shape), dtype=torch.float32, device=groups.device)
    if groups.is_last_stage:
        start = 0
        for mb, d in zip(micro, store):
            idx = rows[start : start + len(mb)].to(groups.device)
            start += len(mb)
            for i, key in enumerate(keys):
                buf[i, idx, : d[key].shape[1]] = d[key]
    if groups.pp_size > 1:
        torch.distributed.broadcast(buf, src=groups.pp_last_rank, group=groups.pp_group)
    return buf.cpu()


def _moe_padding_mask(model, mb: Rollouts, width: int, packed, dummy: bool, groups: ParallelGroups):
    """The padding mask MoE routers get (actor/moe/routing.py ``padding_mask``: padding and dummy micro-batches
    stay out of the aux loss and the moe/* metrics); None for a dense model."""
    chunk = _unwrap(model)
    if not chunk.config.num_moe_experts:
        return None
    # megatron scatters the mask over TP under sequence parallelism on the embedding's stage only
    sp_stage = chunk.config.sequence_parallel and groups.tp_size > 1 and not chunk.pre_process
    shard = (groups.tp_rank, groups.tp_size) if sp_stage else None
    return padding_mask(mb.seq_lens, width, packed, dummy, shard).to(groups.device)


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model
