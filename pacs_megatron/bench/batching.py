"""Benchmark: fixed padded micro-batches vs token-budget micro-batches through the real actor, side by side.

    python -m pacs_megatron.bench.batching                      # TP=1 in this process, then TP=2 (2 gloo ranks)
    python -m pacs_megatron.bench.batching --tp 1 --groups 8 --json batching.json

The workload is a synthetic reasoning-RL step: ``--groups`` prompts x ``--n`` responses whose lengths are
long-tailed and correlated within a group. Two random actors with the same weights, one per mode, time the
old-log-prob pass and one optimizer step per round, interleaved (the first mode alternates). ``speedup`` is
the median over rounds of fixed time / dynamic time; the target on the default workload is >= 1.5x.
Workload, columns and results: docs/benchmarks.md, "Padding-free batching".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

MODES = ("fixed", "dynamic")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", default="1,2", help="comma-separated TP sizes, each run as its own job")
    p.add_argument("--groups", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--median-response", type=int, default=64)
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the per-prompt length scale")
    p.add_argument("--within-sigma", type=float, default=0.3, help="log-normal sigma within a group")
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=8, help="rows per fixed micro-batch (one group)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=2, help="timed rounds after one warm-up (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)  # set by the launching process


def synthetic_lengths(args) -> tuple[list[int], list[int]]:
    """Prompt length per group and response length per row (long-tailed, deterministic in --seed)."""
    rng = random.Random(args.seed)
    prompts = [rng.randint(16, args.max_prompt) for _ in range(args.groups)]
    responses = []
    for _ in range(args.groups):
        scale = args.median_response * rng.lognormvariate(0.0, args.sigma)
        for _ in range(args.n):
            responses.append(max(1, min(args.max_response, int(scale * rng.lognormvariate(0.0, args.within_sigma)))))
    return prompts, responses


def _batch(args):
    from pacs_megatron.batch.build import build_rollouts

    prompt_lens, response_lens = synthetic_lengths(args)
    g = torch.Generator().manual_seed(args.seed)
    prompts, responses = [], []
    for k, plen in enumerate(prompt_lens):
        prompt = torch.randint(1, args.vocab, (plen,), generator=g).tolist()
        for j in range(args.n):
            prompts.append(prompt)
            responses.append(torch.randint(1, args.vocab, (response_lens[k * args.n + j],), generator=g).tolist())
    scores = [float(i % 3 == 0) for i in range(len(prompts))]
    return build_rollouts(prompts, responses, scores, args.n, pad_id=0, pad_to_multiple=8)


def _config(args, workdir: Path, tp: int, dynamic: bool):
    from pacs_megatron.config import load_config

    return load_config(
        None,
        [
            f"model.path={workdir}",
            "model.init=random",
            "model.dtype=float32",
            f"parallel.tp={tp}",
            "parallel.backend=gloo",
            f"rollout.n={args.n}",
            f"rollout.max_response_length={args.max_response}",
            f"data.max_prompt_length={args.max_prompt}",
            f"trainer.train_batch_size={args.groups}",
            f"algorithm.micro_batch_size={args.micro_batch_size}",
            f"algorithm.dynamic_batching={str(dynamic).lower()}",
            "optimizer.lr=1e-5",
        ],
    )


def _tokens(micro) -> tuple[int, int]:
    """(computed tokens incl. padding, real tokens) over micro-batches."""
    return sum(m.input_ids.numel() for m in micro), sum(int(m.seq_lens.sum()) for m in micro)


def run_rank(args, workdir: Path, tp: int) -> dict:
    """Both actors on this rank; per-mode token counts, timings and memory."""
    import torch.distributed as dist

    from pacs_megatron.batch.build import split_micro_batches
    from pacs_megatron.batch.rows import as_train_batch
    from pacs_megatron.bench.logprob import _PeakMemory
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import destroy_parallel, initialize_parallel

    cfgs = {m: _config(args, workdir, tp, m == "dynamic") for m in MODES}
    groups = initialize_parallel(cfgs["fixed"].parallel, json.loads((workdir / "config.json").read_text()))
    try:
        actors = {m: build_actor(cfgs[m], groups, str(workdir)) for m in MODES}
        batch = _batch(args)
        mbs = args.micro_batch_size
        out: dict = {"rank": groups.rank, "tp": tp, "rows": len(batch), "threads": torch.get_num_threads()}
        for m, actor in actors.items():
            packed = actor._packed(batch, 0)
            micro = packed[0] if packed else split_micro_batches(batch, mbs)
            computed, real = _tokens(micro)
            out[m] = {
                "micro_batches": len(micro),
                "tokens_computed": computed,
                "tokens_real": real,
                "padding_frac": 1 - real / computed,
                "largest_micro_batch_tokens": max(x.input_ids.numel() for x in micro),
                "logprob_s": [],
                "train_s": [],
                "peak_mb": [],
            }
        for i in range(args.repeat + 1):  # round 0 warms up
            for m in MODES if i % 2 else MODES[::-1]:  # alternate who runs first (load swings, touched pages)
                actor = actors[m]
                dist.barrier()
                t0 = time.perf_counter()
                old = actor.compute_logprobs(batch, micro_batch_size=mbs, temperature=1.0)
                dist.barrier()
                t1 = time.perf_counter()
                with _PeakMemory(torch.device("cpu")) as mem:
                    actor.train_step(as_train_batch(batch, old.token_logp))
                    dist.barrier()
                t2 = time.perf_counter()
                if i:
                    out[m]["logprob_s"].append(t1 - t0)
                    out[m]["train_s"].append(t2 - t1)
                    out[m]["peak_mb"].append(mem.peak / 2**20)
        f, d = out["fixed"], out["dynamic"]
        rounds = [(a + b) / (c + e) for a, b, c, e in zip(f["logprob_s"], f["train_s"], d["logprob_s"], d["train_s"])]
        out["speedup"] = statistics.median(rounds)
        out["speedup_rounds"] = rounds
        return out
    finally:
        destroy_parallel()


def _print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from pacs_megatron.bench.sync import _cpu_name

    console = Console()
    a = report["args"]
    table = Table(
        title=f"actor passes, {a['groups']} prompts x n={a['n']}, responses log-normal median "
        f"{a['median_response']} (max {a['max_response']}), hidden {a['hidden']} x {a['layers']} layers"
    )
    cols = ("tp", "mode", "micro-batches", "tokens computed", "largest", "padding", "logprob s", "train s", "peak MB")
    for col in cols:
        table.add_column(col, justify="right")
    for r in report["runs"]:
        for m in MODES:
            x = r[m]
            table.add_row(
                str(r["tp"]),
                m,
                str(x["micro_batches"]),
                str(x["tokens_computed"]),
                str(x["largest_micro_batch_tokens"]),
                f"{x['padding_frac']:.0%}",
                f"{statistics.median(x['logprob_s']):.2f}",
                f"{statistics.median(x['train_s']):.2f}",
                f"{statistics.median(x['peak_mb']):.0f}",
            )
    console.print(table)
    for r in report["runs"]:
        tokens = r["fixed"]["tokens_computed"] / r["dynamic"]["tokens_computed"]
        console.print(f"speedup tp={r['tp']}: {r['speedup']:.2f}x (tokens computed: {tokens:.2f}x fewer)")
    console.print(
        f"[dim]{_cpu_name()} x{os.cpu_count()}, torch {torch.__version__}, load {report['load_avg_at_start']}; "
        "speedup = median over rounds of fixed / dynamic time of both actor passes; target >= 1.5x[/dim]"
    )


def _rank_main(args, workdir: Path, tp: int) -> int:
    """One rank's measurement, left in ``workdir`` for the process that started the job. The environment
    is put back afterwards: a one-rank job run in the driver sets RANK / WORLD_SIZE (parallel/groups.py),
    which would make the next ``--tp`` job look as if a launcher had already started its ranks."""
    env = dict(os.environ)
    try:
        result = run_rank(args, workdir, tp)
    finally:
        os.environ.clear()
        os.environ.update(env)
    (workdir / f"rank{result['rank']}.json").write_text(json.dumps(result))
    return 0


def main(args: argparse.Namespace) -> int:
    from pacs_megatron.bench.sync import _write_model_dir
    from pacs_megatron.launch.local import on_ranks

    tps = [int(x) for x in str(args.tp).split(",")]
    if args.workdir:  # one rank of a TP job started below
        return _rank_main(args, Path(args.workdir), int(os.environ["WORLD_SIZE"]))
    report = {"args": {k: v for k, v in vars(args).items() if k != "workdir"}, "runs": []}
    report["load_avg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    shape = SimpleNamespace(
        vocab=args.vocab,
        hidden=args.hidden,
        ffn=4 * args.hidden,
        layers=args.layers,
        heads=4,
        kv_heads=2,
        untied=False,
        dtype="float32",
    )
    for tp in tps:
        with tempfile.TemporaryDirectory(prefix="pacs_batching_bench_") as tmp:
            workdir = Path(tmp)
            _write_model_dir(workdir, shape)
            argv = ["pacs_megatron.bench.batching", *sys.argv[1:], "--workdir", str(workdir)]
            code = on_ranks(argv, tp, lambda: _rank_main(args, workdir, tp))  # noqa: B023 - called at once
            if code:
                return code
            report["runs"].append(json.loads((workdir / "rank0.json").read_text()))
    if args.json:  # first: the report survives a failure to print it
        Path(args.json).write_text(json.dumps(report, indent=2))
    _print_report(report)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
