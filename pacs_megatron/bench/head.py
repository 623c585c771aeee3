"""Benchmark rows of the fused LM head (issue 44), run by ``bench/logprob.py --head H`` beside the logits rows.

    python -m pacs_megatron.bench.logprob --device cpu --head 576 --shapes 8192x49152 --threads 2

Inputs: hidden ``[N, H]`` and one rank's output weight ``[V, H]`` (``--tp W``: ``[V / W, H]``); every candidate
computes the masked sum of the targets' log-probs from them, forward and forward+backward (gradients of
hidden and weight, ``torch.autograd.grad``):
- head-fused   ``fused_head_logprobs`` (ops/head.py): one ``[N, Vc]`` logits block at a time
- head+fused   ``hidden @ W.T`` then today's ``fused_logprobs`` with ``inplace_backward=True`` (the actor's
               unfused training path: the logits, and their gradient written into the same buffer)
- head+naive   ``hidden @ W.T`` then ``log_softmax(x / T).gather``, torch autograd
Memory is the peak extra over the inputs (``bench/logprob.py``'s probe: peak RSS on CPU), also expressed
as vocabulary-sized buffers a token: peak bytes / (N * V * element size), the issue's unit.
The TP collectives (one [N, 4] all-gather, the grad_hidden all-reduce) are not timed.
"""

from __future__ import annotations

import statistics
import time

import torch

from pacs_megatron.ops import fused_head_logprobs, fused_logprobs

HEAD_CANDIDATES = ("head-fused", "head+fused", "head+naive")


def _summed(out) -> torch.Tensor:
    """The masked sum of a result's log-probs (the candidates are called with a mask, so it is there)."""
    if out.seq_logp is None:
        raise ValueError("the head candidates need a mask: their loss is the masked sum of log-probs")
    return out.seq_logp.sum()


def head_candidate(name: str, temperature: float, block_cols: int | None):
    """fn(hidden, weight, targets, mask) -> scalar loss (masked sum of log-probs)."""
    if name == "head-fused":
        return lambda h, w, t, m: _summed(
            fused_head_logprobs(h, w, t, m, temperature=temperature, block_cols=block_cols, impl="ext")
        )
    if name == "head+fused":
        return lambda h, w, t, m: _summed(
            fused_logprobs(h @ w.t(), t, m, temperature=temperature, inplace_backward=True, impl="ext")
        )
    if name == "head+naive":

        def naive(h, w, t, m):
            logp = torch.log_softmax((h @ w.t()) / temperature, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
            return torch.where(m, logp, torch.zeros_like(logp)).sum()

        return naive
    raise ValueError(f"--head-candidates: unknown {name!r} (use {', '.join(HEAD_CANDIDATES)})")


def _time_one(fn, hidden, weight, targets, mask, *, backward: bool, probe, device) -> tuple[float, int]:
    h, w = hidden.detach().requires_grad_(backward), weight.detach().requires_grad_(backward)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with probe(device) as mem:
        t0 = time.perf_counter()
        loss = fn(h, w, targets, mask)
        if backward:
            grads = torch.autograd.grad(loss, [h, w])
            del grads
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        del loss
    return elapsed, mem.peak


def bench_head_shape(n: int, v: int, hsize: int, args, device, dtype, probe) -> dict:
    """One ``N x V x H`` row: ms and peak extra memory of each candidate, forward and forward+backward."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, n, hsize, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(v, hsize, generator=gen) / hsize**0.5).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (1, n), generator=gen).to(device)
    mask = (torch.rand(1, n, generator=gen) > 0.2).to(device)
    vocab_buffer = n * v * hidden.element_size()
    row = {"N": n, "V": v, "H": hsize, "dtype": args.dtype, "candidates": {}}
    for name in args.head_candidates.split(","):
        fn = head_candidate(name, args.temperature, args.block_cols)
        res = {}
        for mode, backward in (("fwd", False), ("fwd_bwd", True)):
            runs = [
                _time_one(fn, hidden, weight, targets, mask, backward=backward, probe=probe, device=device)
                for _ in range(args.repeat + 1)
            ][1:]
            res[f"{mode}_ms"] = 1e3 * statistics.median(r[0] for r in runs)
            peak = max(r[1] for r in runs)
            res[f"{mode}_peak_extra_mb"] = peak / 2**20
            res[f"{mode}_vocab_buffers_per_token"] = peak / vocab_buffer
        row["candidates"][name] = res
    c = row["candidates"]
    if "head-fused" in c:
        for other in ("head+fused", "head+naive"):
            if other in c:
                row[f"speedup_vs_{other}"] = {
                    m: c[other][f"{m}_ms"] / c["head-fused"][f"{m}_ms"] for m in ("fwd", "fwd_bwd")
                }
    return row


def print_head_table(row: dict, device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"LM head N={row['N']} V={row['V']} H={row['H']} {row['dtype']} ({device})")
    for col in ("candidate", "fwd ms", "fwd+bwd ms", "fwd peak MB", "fwd+bwd peak MB", "V-buffers/token"):
        table.add_column(col, justify="right")
    for name, res in row["candidates"].items():
        table.add_row(
            name,
            f"{res['fwd_ms']:.0f}",
            f"{res['fwd_bwd_ms']:.0f}",
            f"{res['fwd_peak_extra_mb']:.0f}",
            f"{res['fwd_bwd_peak_extra_mb']:.0f}",
            f"{res['fwd_bwd_vocab_buffers_per_token']:.3f}",
        )
    console.print(table)
    for key in ("speedup_vs_head+fused", "speedup_vs_head+naive"):
        if key in row:
            console.print(f"  {key}: " + ", ".join(f"{k} {v:.2f}x" for k, v in row[key].items()))
