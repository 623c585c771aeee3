"""Benchmark: a rank's train-step peak memory and step time at long sequences, parallel.cp = 1 vs cp.

    python -m pacs_megatron.bench.cp_memory --cp 2 --seq 4096     # one process at CP = 1, then 2 ranks at CP = 2

Each layout runs in fresh processes (one cannot hide the other's peak): a tiny random Qwen2 with a small
vocabulary, so the activations, not the logits, dominate; one warm-up step (Adam state), then the measured
step. Reported per rank: peak extra RSS over the state before the step, and the step's wall time. glibc
serves allocations of 64 KiB and more by mmap here, so the RSS follows the live tensors (with its default
thresholds the same run read 176-359 MB at CP = 1). Results: docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cp", type=int, default=2, help="the CP size compared with CP = 1")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (prompt 32 + response)")
    p.add_argument("--rows", type=int, default=2, help="sequences (one group) per micro-batch")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-cp", type=int, default=0, help=argparse.SUPPRESS)


def _rank(args) -> dict:
    from pacs_megatron.actor import MegatronActor
    from pacs_megatron.bench.logprob import _PeakMemory
    from pacs_megatron.bench.sync import _write_model_dir
    from pacs_megatron.config import load_config
    from pacs_megatron.data.batching import as_train_batch, build_rollouts
    from pacs_megatron.parallel import destroy_parallel, initialize_parallel

    workdir = Path(args.workdir)
    shape = dict(hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2, ffn=2 * args.hidden, vocab=args.vocab)
    if int(os.environ.get("RANK", "0")) == 0:
        _write_model_dir(workdir, SimpleNamespace(**shape, untied=False, dtype="float32"))
    overrides = [
        f"model.path={workdir}",
        "model.init=random",
        "model.dtype=float32",
        "parallel.backend=gloo",
        f"parallel.cp={args.child_cp}",
        f"rollout.n={args.rows}",
        f"algorithm.micro_batch_size={args.rows}",
        f"algorithm.logprob_micro_batch_size={args.rows}",
        "algorithm.dynamic_batching=false",
        "trainer.train_batch_size=1",
    ]
    cfg = load_config(None, overrides)
    while not (workdir / "config.json").exists():  # rank 0 writes it
        time.sleep(0.1)
    groups = initialize_parallel(cfg.parallel, json.loads((workdir / "config.json").read_text()))
    try:
        actor = MegatronActor(cfg, groups, str(workdir))
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, args.vocab, (32,), generator=gen).tolist() for _ in range(args.rows)]
        responses = [torch.randint(1, args.vocab, (args.seq - 32,), generator=gen).tolist() for _ in range(args.rows)]
        batch = build_rollouts(prompts, responses, [float(i % 2) for i in range(args.rows)], args.rows, pad_id=0)
        old = actor.compute_logprobs(batch, micro_batch_size=args.rows, temperature=1.0).token_logp
        batch = as_train_batch(batch, old)
        actor.train_step(batch)  # warm-up: Adam state allocated
        start = time.perf_counter()
        with _PeakMemory(groups.device) as mem:
            metrics = actor.train_step(batch)
        return {
            "cp": args.child_cp,
            "rank": groups.rank,
            "peak_extra_mb": mem.peak / 2**20,
            "step_s": time.perf_counter() - start,
            "method": mem.method,
            "grad_norm": metrics["actor/grad_norm"],
        }
    finally:
        destroy_parallel()


def main(args: argparse.Namespace) -> int:
    if args.child_cp:  # one rank of one layout
        from pacs_megatron.launch.local import on_ranks

        def rank_main() -> int:
            result = _rank(args)
            Path(args.workdir, f"cp{args.child_cp}_rank{result['rank']}.json").write_text(json.dumps(result))
            return 0

        argv = ["pacs_megatron.bench.cp_memory", *sys.argv[1:]]
        return on_ranks(argv, args.child_cp, rank_main)
    flags = [f"--{k}={getattr(args, k)}" for k in ("seq", "rows", "hidden", "layers", "vocab")]
    results = {}
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    with tempfile.TemporaryDirectory(prefix="pacs_cp_bench_") as tmp:
        for cp in (1, args.cp):
            wd = Path(tmp) / f"cp{cp}"
            wd.mkdir()
            cmd = [sys.executable, "-m", "pacs_megatron.bench.cp_memory", *flags, f"--child-cp={cp}", f"--workdir={wd}"]
            subprocess.run(cmd, check=True, env=env)
            results[cp] = [json.loads(f.read_text()) for f in sorted(wd.glob(f"cp{cp}_rank*.json"))]
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("workdir", "json", "child_cp")}}
    report["results"] = {str(cp): r for cp, r in results.items()}
    from rich.console import Console

    for cp, ranks in results.items():
        peak = max(r["peak_extra_mb"] for r in ranks)
        step = max(r["step_s"] for r in ranks)
        Console().print(f"cp={cp}: peak extra {peak:.0f} MB per rank, step {step:.2f} s ({ranks[0]['method']})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pacs_megatron.bench.cp_memory", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
