"""Benchmark: the actor's train-step peak memory with the old and the new logits -> log-prob path, side by side.

    python -m pacs_megatron.bench.memory                         # vocab 32768, hidden 64, 8 x 256 tokens, fp32
    python -m pacs_megatron.bench.memory --vocab 65536 --json mem.json

Variants, each in a FRESH process so that one cannot hide the other's peak: ``sliced`` (the path before the
fix: every token's logits, sliced, a fresh N x V gradient) and ``inplace`` (actor/forward.py: the response rows'
logits only, the gradient written into the logits buffer). Both unfused (``model.fused_lm_head=false``: the
fused head holds no logits at all, bench/head.py) and padded (no THD packing). A vocab-heavy tiny Qwen2, so the
N x V buffers dominate; the second step's peak RSS over RSS before it is reported beside the N x V size. Method
and results: docs/benchmarks.md, "GPU readiness: training-pass memory".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

VARIANTS = ("sliced", "inplace")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=8, help="sequences per micro-batch (one micro-batch)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (prompt 32 + response)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--variant", choices=VARIANTS, default=None, help=argparse.SUPPRESS)  # child process
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)


def _sliced_token_logprobs(
    logits, input_ids, spec, groups, temperature, with_entropy=False, inplace_backward=False, thd=None, rows=None
):
    """The training pass's log-prob call before the fix (kept here only to measure it): padded rows, every
    token's logits (the sliced child turns the selection of response rows off)."""
    if thd is not None or rows is not None:
        raise ValueError("the sliced variant measures padded rows with every token's logits: no thd, no rows")
    import torch.nn.functional as F

    from pacs_megatron.actor.model import mask_padded_vocab
    from pacs_megatron.ops import fused_logprobs

    logits = mask_padded_vocab(logits, spec, groups)
    rec = fused_logprobs(logits[:, :-1], input_ids[:, 1:], temperature=temperature, tp_group=groups.tp_group)
    return F.pad(rec.token_logp.float(), (1, 0)), None


def measure_train_step(args, overrides: list[str], group: int, write_model: bool = True) -> dict:
    """One timed, memory-measured actor train step of ``args.rows`` random rows of ``args.seq`` tokens (groups of
    ``group``) on a tiny random Qwen2 (``args.hidden/layers/vocab``) in ``args.workdir``, after a warm-up step that
    allocates Adam's state. ``overrides`` join the shared ones (the model, fp32, gloo, one micro-batch);
    ``write_model=False``: another rank writes the model directory and this one waits for it. Returns the peak
    extra bytes and their method (``_PeakMemory``), the step's seconds, its metrics, the rank and the batch shape."""
    from pacs_megatron.batch.build import build_rollouts
    from pacs_megatron.batch.rows import as_train_batch
    from pacs_megatron.bench.logprob import _PeakMemory
    from pacs_megatron.bench.sync import _write_model_dir
    from pacs_megatron.config import load_config
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import destroy_parallel, initialize_parallel

    workdir = Path(args.workdir)
    shape = dict(hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2, ffn=2 * args.hidden, vocab=args.vocab)
    if write_model:
        _write_model_dir(workdir, SimpleNamespace(**shape, untied=False, dtype="float32"))
    shared = [f"model.path={workdir}", "model.init=random", "model.dtype=float32", "parallel.backend=gloo"]
    shared += [f"algorithm.micro_batch_size={args.rows}", f"algorithm.logprob_micro_batch_size={args.rows}"]
    cfg = load_config(None, [*shared, *overrides])
    while not (workdir / "config.json").exists():  # written above, or by another rank
        time.sleep(0.1)
    groups = initialize_parallel(cfg.parallel, json.loads((workdir / "config.json").read_text()))
    try:
        actor = build_actor(cfg, groups, str(workdir))
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, args.vocab, (32,), generator=gen).tolist() for _ in range(args.rows)]
        responses = [torch.randint(1, args.vocab, (args.seq - 32,), generator=gen).tolist() for _ in range(args.rows)]
        scores = [float(i % 2) for i in range(args.rows)]
        batch = build_rollouts(prompts, responses, scores, group, pad_id=0)
        old = actor.compute_logprobs(batch, micro_batch_size=args.rows, temperature=1.0).token_logp
        batch = as_train_batch(batch, old)
        actor.train_step(batch)  # warm-up: Adam state allocated
        start = time.perf_counter()
        with _PeakMemory(groups.device) as mem:
            metrics = actor.train_step(batch)
        step_s = time.perf_counter() - start
        return {"peak": mem.peak, "method": mem.method, "step_s": step_s, "metrics": metrics, "rank": groups.rank,
                "shape": tuple(batch.input_ids.shape)}  # fmt: skip
    finally:
        destroy_parallel()


def _child(args) -> dict:
    from pacs_megatron.actor import train_step as train_step_mod

    if args.variant == "sliced":  # the path before both fixes: every token's logits, sliced
        from pacs_megatron.actor import forward

        train_step_mod.token_logprobs = _sliced_token_logprobs
        forward.selects_rows = lambda model: False
    group = 4
    overrides = [f"rollout.n={group}", f"trainer.train_batch_size={args.rows // group}"]
    # the logits -> log-prob path is what the variants differ in: unfused, padded rows (no THD packing) in both
    overrides += ["model.fused_lm_head=false", "algorithm.dynamic_batching=false"]
    step = measure_train_step(args, overrides, group)
    n, t = step["shape"]
    return {
        "variant": args.variant,
        "peak_extra_mb": step["peak"] / 2**20,
        "method": step["method"],
        "nv_fp32_mb": n * t * args.vocab * 4 / 2**20,
        "grad_norm": step["metrics"]["actor/grad_norm"],
    }


def main(args: argparse.Namespace) -> int:
    if args.variant:  # one variant, in this fresh process
        result = _child(args)
        Path(args.workdir, f"{args.variant}.json").write_text(json.dumps(result))
        return 0
    flags = ["--vocab", str(args.vocab), "--hidden", str(args.hidden), "--layers", str(args.layers)]
    flags += ["--rows", str(args.rows), "--seq", str(args.seq)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="pacs_mem_bench_") as tmp:
        for variant in VARIANTS:
            wd = Path(tmp) / variant
            wd.mkdir()
            cmd = [
                sys.executable,
                "-m",
                "pacs_megatron.bench.memory",
                *flags,
                "--variant",
                variant,
                "--workdir",
                str(wd),
            ]
            subprocess.run(cmd, check=True)
            results[variant] = json.loads((wd / f"{variant}.json").read_text())
    s, i = results["sliced"], results["inplace"]
    report = {
        "args": {k: v for k, v in vars(args).items() if k not in ("variant", "workdir", "json")},
        "results": results,
        "saved_mb": s["peak_extra_mb"] - i["peak_extra_mb"],
        "saved_in_nv_buffers": (s["peak_extra_mb"] - i["peak_extra_mb"]) / s["nv_fp32_mb"],
        "ratio_inplace_vs_sliced": i["peak_extra_mb"] / s["peak_extra_mb"],
    }
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"actor train-step peak memory, vocab {args.vocab}, {args.rows} x {args.seq} tokens, fp32")
    for col in ("variant", "peak extra MB", "N x V fp32 MB", "method"):
        table.add_column(col, justify="right")
    for r in results.values():
        table.add_row(r["variant"], f"{r['peak_extra_mb']:.0f}", f"{r['nv_fp32_mb']:.0f}", r["method"])
    Console().print(table)
    Console().print(f"saved {report['saved_mb']:.0f} MB = {report['saved_in_nv_buffers']:.2f} N x V buffers")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pacs_megatron.bench.memory", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
