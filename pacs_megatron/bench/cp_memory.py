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
from pathlib import Path


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
    from pacs_megatron.bench.memory import measure_train_step

    overrides = [f"parallel.cp={args.child_cp}", f"rollout.n={args.rows}", "algorithm.dynamic_batching=false"]
    overrides.append("trainer.train_batch_size=1")
    step = measure_train_step(args, overrides, args.rows, write_model=int(os.environ.get("RANK", "0")) == 0)
    return {
        "cp": args.child_cp,
        "rank": step["rank"],
        "peak_extra_mb": step["peak"] / 2**20,
        "step_s": step["step_s"],
        "method": step["method"],
        "grad_norm": step["metrics"]["actor/grad_norm"],
    }


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
