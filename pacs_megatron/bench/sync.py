"""Benchmark: actor -> engine weight sync throughput beside a plain memcpy of the same bytes, in one run.

    python -m pacs_megatron.bench.sync                          # ~100M-parameter Qwen2 shape, fp32, TP=1
    python -m pacs_megatron.bench.sync --tp 2 --bucket-mb 64 --json sync.json

Each rank builds a random megatron-core actor (:class:`MegatronActor`) and an :class:`HFEngine` of the same
shape, then times, interleaved, ``--repeat`` rounds after one warm-up (medians): ``sync`` (``WeightSync.push()``,
the trainer's path, probe excluded), ``export`` (the same stream without loading) and ``memcpy`` (the same
bytes copied into the engine: the floor). The target is sync / memcpy >= 0.5 on CPU. ``--tp N`` re-launches
as N gloo ranks; ``--lora-rank R --config FILE`` times a LoRA actor's three syncs into vLLM instead
(bench/sync_lora.py). Method and results: docs/benchmarks.md, "Weight sync".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

# Default: a ~100M-parameter Qwen2 (tied embeddings): 32000 x 768 embedding + 12 layers of 6.3M.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_SHAPE = dict(hidden=768, layers=12, heads=12, kv_heads=4, ffn=2048, vocab=32000)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=DEFAULT_SHAPE["hidden"])
    p.add_argument("--layers", type=int, default=DEFAULT_SHAPE["layers"])
    p.add_argument("--heads", type=int, default=DEFAULT_SHAPE["heads"])
    p.add_argument("--kv-heads", type=int, default=DEFAULT_SHAPE["kv_heads"])
    p.add_argument("--ffn", type=int, default=DEFAULT_SHAPE["ffn"])
    p.add_argument("--vocab", type=int, default=DEFAULT_SHAPE["vocab"])
    p.add_argument("--untied", action="store_true", help="separate LM head (default: tied, as small Qwen2.5)")
    p.add_argument("--tp", type=int, default=1, help="trainer tensor parallelism (local gloo ranks)")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype sent to and held by the engine")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions after one warm-up (median)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads per rank")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--config", default=None, help="with --lora-rank: the run config whose model and layout to use")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --config: an override")
    p.add_argument(
        "--lora-rank", type=int, default=0, help="> 0: full vs merged vs adapter-only syncs into vLLM (--config)"
    )
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)  # set by the launching process


def _write_model_dir(path: Path, args) -> None:
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": not args.untied,
        "hidden_act": "silu",
        "torch_dtype": args.dtype,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def _timed(fn, barrier) -> float:
    barrier()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def run_rank(args, workdir: Path) -> dict:
    """Build actor and engine on this rank, time sync / export / memcpy; return this rank's numbers."""
    import torch.distributed as dist

    from pacs_megatron.config import load_config
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import destroy_parallel, initialize_parallel
    from pacs_megatron.rollout.hf_engine import HFEngine
    from pacs_megatron.weight_sync import WeightSync

    cfg = load_config(
        None,
        [
            f"model.path={workdir}",
            "model.init=random",
            # bf16 actors need a GPU (megatron's fp16 optimizer type-checks torch.cuda tensors): on CPU the
            # actor stays fp32 and --dtype is what is sent and what the engine holds (sync.dtype)
            f"model.dtype={args.dtype if torch.cuda.is_available() else 'float32'}",
            f"sync.dtype={args.dtype}",
            f"parallel.tp={args.tp}",
            "parallel.backend=gloo",
            f"sync.bucket_mb={args.bucket_mb}",
            "sync.probe_sequences=0",
        ],
    )
    groups = initialize_parallel(cfg.parallel, json.loads((workdir / "config.json").read_text()))
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        actor = build_actor(cfg, groups, str(workdir))
        stub_tokenizer = SimpleNamespace(eos_token_id=0, pad_token_id=0)
        engine = HFEngine(workdir, stub_tokenizer, device="cpu", dtype=DTYPES[args.dtype])
        sync = WeightSync(actor, engine, cfg.sync, args.vocab, actor.param_dtype)
        params = list(engine.model.parameters())
        sources = [torch.empty_like(p).uniform_(-1, 1) for p in params]
        nbytes = sum(p.numel() * p.element_size() for p in params)

        def memcpy():
            with torch.no_grad():
                for p, s in zip(params, sources):
                    p.copy_(s)

        def export():
            for _ in actor.export_hf_weights():
                pass

        pushed = []

        def push():
            pushed.append(sync.push())

        results: dict[str, list[float]] = {"sync": [], "export": [], "memcpy": []}
        for i in range(args.repeat + 1):  # round 0 is the warm-up
            t_mem = _timed(memcpy, dist.barrier)
            t_exp = _timed(export, dist.barrier)
            t_sync = _timed(push, dist.barrier)
            if i:
                results["memcpy"].append(t_mem)
                results["export"].append(t_exp)
                results["sync"].append(t_sync)
        med = {k: statistics.median(v) for k, v in results.items()}
        gbytes, buckets = pushed[-1].gbytes, pushed[-1].buckets
        # per-round throughput ratios: adjacent timings share the machine's load of the moment
        rounds = [m / s for s, m in zip(results["sync"], results["memcpy"])]  # same bytes land in the engine
        return {
            "rank": groups.rank,
            "params": sum(p.numel() for p in params),
            "engine_gbytes": nbytes / 1e9,
            "sent_gbytes": gbytes,
            "buckets": buckets,
            "seconds": med,
            "all_seconds": results,
            "gbps": {"sync": nbytes / 1e9 / med["sync"], "memcpy": nbytes / 1e9 / med["memcpy"]},
            "ratio_sync_vs_memcpy": statistics.median(rounds),
            "ratio_of_medians": med["memcpy"] / med["sync"],
            "bucket_bytes": sync.bucket_bytes,
            "export_share_of_sync": med["export"] / med["sync"],
            "threads": torch.get_num_threads(),
        }
    finally:
        destroy_parallel()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _flags(args) -> list[str]:
    out = []
    for k, v in vars(args).items():
        if v in (None, False, []) or k == "workdir" or (k == "lora_rank" and not v):
            continue
        for item in v if isinstance(v, list) else [v]:  # --set, once per override
            out.append(f"--{k.replace('_', '-')}" + ("" if item is True else f" {item}"))
    return out


def _environment(args) -> dict:
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "command": "python -m pacs_megatron.bench.sync " + " ".join(_flags(args)),
    }


def _print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    r = report["ranks"][0]
    a = report["args"]
    title = f"weight sync, {r['params'] / 1e6:.0f}M params, {a['dtype']}, tp={a['tp']}, bucket {a['bucket_mb']} MiB"
    table = Table(title=title)
    for col in ("rank", "sync s", "export s", "memcpy s", "sync GB/s", "memcpy GB/s", "sync / memcpy"):
        table.add_column(col, justify="right")
    for r in report["ranks"]:
        s, g = r["seconds"], r["gbps"]
        table.add_row(
            str(r["rank"]),
            f"{s['sync']:.3f}",
            f"{s['export']:.3f}",
            f"{s['memcpy']:.3f}",
            f"{g['sync']:.2f}",
            f"{g['memcpy']:.2f}",
            f"{r['ratio_sync_vs_memcpy']:.0%}",
        )
    console.print(table)
    env = report["environment"]
    console.print(
        f"[dim]{env['date']} {env['cpu']} x{env['cores']} torch {env['torch']} threads/rank "
        f"{report['ranks'][0]['threads']} load {env['load_avg_at_start']}; {r['sent_gbytes']:.3f} GB in "
        f"{r['buckets']} buckets ({'one tensor each' if r['bucket_bytes'] == 1 else r['bucket_bytes']} B) "
        "sent; target sync/memcpy >= 50%; "
        "sync / memcpy is the median of per-round ratios[/dim]"
    )


def _rank_main(args: argparse.Namespace, workdir: Path) -> int:
    """One rank's measurement, left in ``workdir`` for the process that started the job."""
    result = run_rank(args, workdir)
    (workdir / f"rank{result['rank']}.json").write_text(json.dumps(result))
    return 0


def main(args: argparse.Namespace) -> int:
    from pacs_megatron.launch.local import on_ranks

    if args.lora_rank:
        from pacs_megatron.bench.sync_lora import main as lora_main

        return lora_main(args, _environment(args))
    if args.workdir:  # one rank of the --tp N job started below
        return _rank_main(args, Path(args.workdir))
    env = _environment(args)
    with tempfile.TemporaryDirectory(prefix="pacs_sync_bench_") as tmp:
        workdir = Path(tmp)
        _write_model_dir(workdir, args)
        argv = ["pacs_megatron.bench.sync", *sys.argv[1:], "--workdir", str(workdir)]
        code = on_ranks(argv, args.tp, lambda: _rank_main(args, workdir))
        if code:
            return code
        ranks = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(args.tp)]
    report = {"environment": env, "args": {k: v for k, v in vars(args).items() if k != "workdir"}, "ranks": ranks}
    _print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
