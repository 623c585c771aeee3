"""Vocab-parallel log-probs over gloo: TP=4 and TP=2 (two TP groups of 2) in ONE 4-rank launch.

Per TP size, each rank passes its vocab shard and checks that
- the fused op equals the unsharded fused op and the fp64 reference (values, and the gradient of every shard
  equals the matching slice of the unsharded gradient), token_logp, seq_logp and entropy with temperature;
- it equals megatron-core 0.16.1 ``vocab_parallel_cross_entropy`` (negated) on the same shards; that function
  takes no group argument (it reads ``parallel_state``, so the TP groups come from
  ``initialize_model_parallel``) and overwrites fp32 logits in place, so it gets a clone;
- exactly one collective runs in forward and none in backward (counted by wrapping torch.distributed);
- the pure-torch reference path (the fallback) is correct under TP too.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from pacs_megatron.ops import fused_logprobs, reference_logprobs

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)


class CollectiveCounter:
    """Counts outermost torch.distributed collective calls while installed (wrappers calling wrappers count once)."""

    def __init__(self):
        self.calls: list[str] = []
        self._depth = 0
        self._saved = {}

    def __enter__(self):
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.calls.append(name)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _check_tp(tp: int, rank_in_tp: int, group, dtype) -> dict:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(100 + tp)  # same full tensors on every rank
    b, t, v_local, temp = 2, 5, 251, 0.9  # V_local odd: no vector-width alignment
    v = tp * v_local
    full = (torch.randn(b, t, v, generator=gen, dtype=torch.float64) * 2).to(dtype)
    targets = torch.randint(0, v, (b, t), generator=gen)
    mask = torch.rand(b, t, generator=gen) > 0.3
    w_tok, w_seq, w_ent = (
        torch.randn(b, t, generator=gen),
        torch.randn(b, generator=gen),
        torch.randn(b, t, generator=gen),
    )
    lo, hi = rank_in_tp * v_local, (rank_in_tp + 1) * v_local

    def loss(out):
        return (out.token_logp * w_tok).sum() + (out.seq_logp * w_seq).sum() + (out.entropy * w_ent).sum()

    res = {}
    for impl in ("ext", "reference"):
        shard = full[..., lo:hi].clone().requires_grad_()
        with CollectiveCounter() as fwd:
            out = fused_logprobs(shard, targets, mask, temperature=temp, tp_group=group, return_entropy=True, impl=impl)
        with CollectiveCounter() as bwd:
            loss(out).backward()
        whole = full.clone().requires_grad_()
        ref = fused_logprobs(whole, targets, mask, temperature=temp, return_entropy=True, impl=impl)
        loss(ref).backward()
        oracle = reference_logprobs(
            full.double(), targets, mask, temperature=temp, return_entropy=True, compute_dtype=torch.float64
        )
        res[impl] = {
            "fwd_calls": fwd.calls,
            "bwd_calls": bwd.calls,
            "vs_unsharded": max(_rel(getattr(out, k), getattr(ref, k)) for k in ("token_logp", "seq_logp", "entropy")),
            "grad_vs_unsharded": _rel(shard.grad, whole.grad[..., lo:hi]),
            "vs_fp64": max(_rel(getattr(out, k), getattr(oracle, k)) for k in ("token_logp", "seq_logp", "entropy")),
        }

    # megatron-core on the same shards (logits / T: it has no temperature); it overwrites its fp32 input in place
    mg_in = (full[..., lo:hi].detach().float() / temp).clone().requires_grad_()  # fp32: no bf16 rounding of x/T
    mg_loss = vocab_parallel_cross_entropy(mg_in, targets)
    (mg_loss * -w_tok).sum().backward()
    shard = full[..., lo:hi].clone().requires_grad_()
    out = fused_logprobs(shard, targets, temperature=temp, tp_group=group, impl="ext")
    (out.token_logp * w_tok).sum().backward()
    res["megatron"] = {"value": _rel(out.token_logp, -mg_loss.detach()), "grad": _rel(shard.grad, mg_in.grad / temp)}
    return res


def _body(rank: int, world: int) -> dict:
    from megatron.core import parallel_state

    results = {}
    for tp in (world, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        group = parallel_state.get_tensor_model_parallel_group()
        rank_in_tp = dist.get_rank(group)
        results[tp] = {str(dt): _check_tp(tp, rank_in_tp, group, dt) for dt in (torch.float32, torch.bfloat16)}
        parallel_state.destroy_model_parallel()
    return results


@pytest.mark.distributed
def test_vocab_parallel_tp4_and_tp2():
    per_rank = run_distributed(_body, 4)
    for rank, results in enumerate(per_rank):
        for tp, by_dtype in results.items():
            for dt, res in by_dtype.items():
                where = f"rank {rank} tp {tp} {dt}"
                fp32 = dt == "torch.float32"
                tol = 1e-5 if fp32 else 1e-4  # bf16: shards combine in a different order; inputs are the same bf16
                ext, ref = res["ext"], res["reference"]
                assert ext["fwd_calls"] == ["all_gather_single"] or ext["fwd_calls"] == ["all_gather_into_tensor"], (
                    f"{where}: forward collectives {ext['fwd_calls']}"
                )
                assert ext["bwd_calls"] == [], f"{where}: backward collectives {ext['bwd_calls']}"
                for impl, r in (("ext", ext), ("reference", ref)):
                    assert r["vs_unsharded"] < tol, f"{where} {impl}: {r['vs_unsharded']}"
                    assert r["grad_vs_unsharded"] < (1e-5 if fp32 else 1e-2), f"{where} {impl}: grads"
                    assert r["vs_fp64"] < tol, f"{where} {impl}: vs fp64 {r['vs_fp64']}"
                mg = res["megatron"]
                assert mg["value"] < tol and mg["grad"] < (1e-5 if fp32 else 2e-2), f"{where}: vs megatron {mg}"
