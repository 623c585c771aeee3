"""MoE helpers of the actor: per-step router statistics and routing replay (R3).

Statistics (``MoeStats``): a forward hook on every router counts, over one step's training forwards and real
tokens only (:func:`padding_mask`), the tokens sent to each expert and the mean router probability per
expert, summed over DP, PP and (under sequence parallelism) TP, so the metrics are the same on every rank:
``moe/aux_loss`` (the balancing loss, 1.0 balanced, E / k worst) and ``moe/max_token_share``.

Routing replay: megatron-core 0.16.1's ``RouterReplay`` takes one ``[tokens, k]`` index tensor per router;
this module turns a micro-batch's recorded experts ``[b, T, L, k]`` into those, in the order the router sees
its tokens (megatron is sequence-first, ``[s, b]`` flattened):

    padded rows      [T, b]   position-major
    THD-packed rows  [N, 1]   the rows concatenated (actor/thd.py), then the tail padding
    sequence parallel         this TP rank's contiguous slice s in [r * s/tp, (r+1) * s/tp) of either

Definitions and the replay's memory and tests: docs/models.md ("Qwen3-MoE", "Routing replay"); the aux
loss itself is actor/moe/aux_loss.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pacs_megatron.actor.thd import ThdBatch
from pacs_megatron.parallel import ParallelGroups


def padding_mask(
    seq_lens: torch.Tensor,
    width: int,
    packed: ThdBatch | None = None,
    dummy: bool = False,
    shard: tuple[int, int] | None = None,
) -> torch.Tensor:
    """megatron's MoE ``padding_mask`` of a micro-batch (True = padding): ``[b, width]`` for padded rows
    of lengths ``seq_lens``, ``[1, N]`` for THD-packed ones (the tail padding); all True for a ``dummy``.
    ``shard=(tp_rank, tp_size)``: only this rank's sequence slice, for a pipeline stage that gets hidden
    states from the previous one under sequence parallelism (megatron-core 0.16.1 scatters the mask
    only on the stage holding the embedding).

    Example:
        >>> padding_mask(torch.tensor([3, 1]), 4).int().tolist()
        [[0, 0, 0, 1], [0, 1, 1, 1]]
    """
    if packed is None:
        mask = torch.arange(width)[None] >= seq_lens.cpu()[:, None]
    else:
        mask = (torch.arange(packed.input_ids.shape[1]) >= packed.rows.numel())[None]
    if dummy:
        mask = torch.ones_like(mask)
    if shard is not None:
        rank, size = shard
        part = mask.shape[1] // size
        mask = mask[:, rank * part : (rank + 1) * part]
    return mask


def router_valid_tokens(router, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """A router forward's ``(tokens [n, H], valid [n] bool)`` from its arguments ``(input, padding_mask)``
    (the mask, ``[s, b]`` True = padding, as MoELayer passes it; None: every token is real)."""
    x = args[0].reshape(-1, args[0].shape[-1])
    mask = args[1] if len(args) > 1 else None
    if mask is None:
        return x, torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    if mask.numel() != x.shape[0]:
        raise ValueError(f"MoE padding mask of {mask.numel()} positions for a router input of {x.shape[0]} tokens")
    return x, ~mask.reshape(-1).to(x.device, torch.bool)


def routers(chunks: list) -> list[tuple[int, torch.nn.Module]]:
    """(global 0-based layer, router module) of every MoE layer on this rank, in chunk order."""
    out = []
    for c in chunks:
        model = c
        while hasattr(model, "module"):
            model = model.module
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                out.append((layer.layer_number - 1, router))
    return out


class MoeStats:
    """Router statistics of the training forwards of one step (see module docstring)."""

    def __init__(self, chunks: list, num_layers: int, num_experts: int, topk: int) -> None:
        self.num_layers, self.num_experts, self.topk = num_layers, num_experts, topk
        self.active = False
        self._reset()
        found = routers(chunks)
        self.sequence_parallel = bool(found and found[0][1].config.sequence_parallel)
        """Each TP rank counts only its sequence shard: the counts are summed over TP too."""
        for layer, router in found:
            router.register_forward_hook(self._hook(layer))

    def _reset(self) -> None:
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self.prob_sums = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self.tokens = torch.zeros(self.num_layers, dtype=torch.float64)

    def _hook(self, layer: int):
        def hook(router, args, output):
            if not self.active:
                return
            with torch.no_grad():
                x, valid = router_valid_tokens(router, args)
                probs = F.softmax(F.linear(x.float(), router.weight.float()), dim=-1) * valid[:, None]
                routing_map = output[1].reshape(-1, self.num_experts) & valid[:, None]
                self.counts[layer] += routing_map.sum(0).double().cpu()
                self.prob_sums[layer] += probs.sum(0).double().cpu()
                self.tokens[layer] += float(valid.sum())

        return hook

    def start(self) -> None:
        self._reset()
        self.active = True

    def finish(self, groups: ParallelGroups, moe_layers: tuple[int, ...]) -> dict[str, float]:
        """Stop counting; the step's metrics, reduced over DP and PP, and TP under sequence parallelism
        (collective)."""
        self.active = False
        flat = torch.cat([self.counts.flatten(), self.prob_sums.flatten(), self.tokens]).to(groups.device)
        tp = (groups.tp_group, groups.tp_size if self.sequence_parallel else 1)
        for group, size in ((groups.dp_group, groups.dp_size), (groups.pp_group, groups.pp_size), tp):
            if size > 1:
                dist.all_reduce(flat, group=group)
        flat = flat.cpu()
        n = self.num_layers * self.num_experts
        counts = flat[:n].view(self.num_layers, self.num_experts)[list(moe_layers)]
        probs = flat[n : 2 * n].view(self.num_layers, self.num_experts)[list(moe_layers)]
        tokens = flat[2 * n :][list(moe_layers)].clamp(min=1)
        f = counts / (tokens[:, None] * self.topk)
        p = probs / tokens[:, None]
        aux = (self.num_experts * (f * p).sum(-1)).mean()
        share = (counts.max(-1).values / counts.mean(-1).clamp(min=1e-12)).max()
        return {"moe/aux_loss": float(aux), "moe/max_token_share": float(share)}


def replay_order(routed: torch.Tensor, length: int, packed: ThdBatch | None = None) -> torch.Tensor:
    """``[s, b, L, k]``: a micro-batch's recorded experts ``[b, >= length, L, k]`` in the router's token
    order: ``[length, b]`` for padded rows, ``[N, 1]`` for the THD-packed ``packed`` (its tail padding
    gets experts 0..k-1, as batch padding does).

    Example:
        >>> r = torch.arange(8).reshape(2, 2, 1, 2)  # rows [[0 1] [2 3]], [[4 5] [6 7]]
        >>> replay_order(r, 2)[:, :, 0].tolist()
        [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    """
    if packed is None:
        return routed[:, :length].transpose(0, 1)
    k = routed.shape[-1]
    out = torch.arange(k, dtype=routed.dtype).expand(packed.input_ids.shape[1], routed.shape[2], k).clone()
    out[: packed.rows.numel()] = routed[packed.rows, packed.cols]
    return out[:, None]


def set_routing_replay(
    chunk,
    routed: torch.Tensor | None,
    length: int,
    packed: ThdBatch | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> None:
    """Before a forward of ``chunk``: replay ``routed`` ``[b, >= length, L, k]`` (the micro-batch's
    recorded experts per global layer; ``packed``: the THD packing the forward uses), or route normally
    when None. Under sequence parallelism this TP rank's routers get their shard only. No-op for
    routers built without ``moe_enable_routing_replay`` (actor.routing_replay=none)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    seq = None if routed is None else replay_order(routed, length, packed)
    for layer, router in routers([chunk]):
        replay = getattr(router, "router_replay", None)
        if replay is None:
            continue
        replay.clear_indices()  # set_target_indices also appends to a backward list: keep it empty
        if seq is None:
            replay.clear_router_replay_action()
            continue
        mine = seq
        if router.config.sequence_parallel and tp_size > 1:
            if seq.shape[0] % tp_size:
                raise ValueError(f"routing replay: {seq.shape[0]} positions do not split over TP={tp_size}")
            part = seq.shape[0] // tp_size
            mine = seq[tp_rank * part : (tp_rank + 1) * part]
        idx = mine[:, :, layer].reshape(-1, seq.shape[-1])
        replay.set_target_indices(idx.to(router.weight.device, torch.long))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
