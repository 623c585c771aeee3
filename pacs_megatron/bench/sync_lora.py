"""Benchmark: the three weight syncs of a LoRA actor into vLLM, side by side in one run (``bench.sync --lora-rank``).

    python -m pacs_megatron.bench.sync --lora-rank 8 --config examples/configs/cpu_tiny.yaml
    python -m pacs_megatron.bench.sync --lora-rank 8 --config examples/configs/cpu_smollm2.yaml \\
        --set model.path=/work/results/smol_hf --set model.init=pretrained --set model.gguf= --set model.dtype=float32

Every rank builds the trainer's own LoRA actor (adapters moved off B = 0, so merged != base) and vLLM engine,
then times, interleaved, ``--repeat`` rounds after one warm-up (medians): ``full`` (the base, adapters off),
``merged`` (``sync.lora=merged``) and ``adapter`` (``sync.lora=adapter``: a PEFT directory and vLLM's
``add_lora``), as ``WeightSync.push`` with the probe and the bitwise check off. One verified adapter sync
ends the run. What is timed, and the results: docs/benchmarks.md, "LoRA weight sync into vLLM".
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

MODES = ("full", "merged", "adapter")


def _config(args: argparse.Namespace, model_dir: str | None) -> Any:
    from pacs_megatron.config import load_config

    extra = [f"model.path={model_dir}"] if model_dir else []
    return load_config(
        args.config,
        [
            *args.set,
            *extra,
            "rollout.engine=vllm",
            f"actor.lora.rank={args.lora_rank}",
            f"actor.lora.alpha={2 * args.lora_rank}",
            "sync.lora=adapter",
            "sync.verify_bitwise=false",
        ],
    )


def _move_adapters(actor: Any, scale: float = 0.02) -> None:
    """B off zero, seeded: a trained adapter's shape (the merged weights then differ from the base)."""
    from pacs_megatron.actor.lora.adapters import lora_modules
    from pacs_megatron.actor.weights import unwrap

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for c in actor.model:
            for m in lora_modules(unwrap(c)).values():
                m.lora_b.copy_(scale * torch.randn(m.lora_b.shape, generator=g).to(m.lora_b.dtype))


def run_rank(args: argparse.Namespace, model_dir: str | None) -> dict:
    """Build actor and vLLM engine on this rank, time the three syncs; this rank's numbers."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from pacs_megatron.loop.build import build_actor, build_rollout_engine
    from pacs_megatron.parallel import destroy_parallel, initialize_parallel
    from pacs_megatron.rollout.vllm.engine import single_rank_launcher_env
    from pacs_megatron.weight_sync import WeightSync

    cfg = _config(args, model_dir)
    path = Path(cfg.model.path)
    with single_rank_launcher_env():  # a world of one outside a launcher: vLLM's external launcher needs it
        groups = initialize_parallel(cfg.parallel, json.loads((path / "config.json").read_text()))
        engine = None
        try:
            actor = build_actor(cfg, groups, str(path))
            _move_adapters(actor)
            tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer or str(path), local_files_only=True)
            engine = build_rollout_engine(cfg, path, tok, groups.device)
            vocab, dtype = actor.hf_config.vocab_size, actor.param_dtype
            adapter = WeightSync(actor, engine, cfg.sync, vocab, dtype, cfg.rollout)
            merged = WeightSync(actor, engine, replace(cfg.sync, lora="merged"), vocab, dtype, cfg.rollout)
            state = adapter.adapter
            assert state is not None
            seconds: dict[str, list[float]] = {m: [] for m in MODES}
            sizes: dict[str, float] = {}
            parts: dict[str, list[float]] = {"gather": [], "write": [], "load": []}

            def timed(mode: str, fn) -> None:
                dist.barrier()
                start = time.perf_counter()
                sizes[mode] = fn()
                dist.barrier()
                seconds[mode].append(time.perf_counter() - start)

            for i in range(args.repeat + 1):  # round 0 is the warm-up
                timed("full", lambda: adapter.push().gbytes * 1e9)  # the adapter sync's base: adapters off
                state.base_sent()
                timed("adapter", lambda: float(state.push()[1]))
                for k, v in state.parts.items():
                    parts[k].append(v)
                timed("merged", lambda: merged.push().gbytes * 1e9)  # leaves the engine merged, no adapter
                if i == 0:
                    seconds, parts = {m: [] for m in MODES}, {k: [] for k in parts}
            state.base_mark = None  # the next sync sends the base and the adapter, verified end to end
            verified = adapter.sync()
            state.close()
        finally:
            if engine is not None:
                engine.close()
            destroy_parallel()
    med = {m: statistics.median(v) for m, v in seconds.items()}

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(seconds[a], seconds[b]))

    return {
        "rank": groups.rank,
        "bytes": sizes,
        "seconds": med,
        "all_seconds": seconds,
        "adapter_parts_seconds": {k: statistics.median(v) for k, v in parts.items()},
        "ratios": {
            "merged_over_adapter_seconds": ratio("merged", "adapter"),
            "full_over_adapter_seconds": ratio("full", "adapter"),
            "merged_over_full_seconds": ratio("merged", "full"),
            "merged_over_adapter_bytes": sizes["merged"] / sizes["adapter"],
        },
        "probe_max_logprob_diff": verified.max_logprob_diff,
        "probe_greedy_logprob_diff": verified.greedy_logprob_diff,
        "threads": torch.get_num_threads(),
    }


def _print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    a, env = report["args"], report["environment"]
    table = Table(title=f"LoRA weight sync into vLLM, rank {a['lora_rank']}, {a['config']}")
    for col in ("rank", *(f"{m} MB" for m in MODES), *(f"{m} s" for m in MODES), "merged/adapter s", "probe"):
        table.add_column(col, justify="right")
    for r in report["ranks"]:
        b, s = r["bytes"], r["seconds"]
        table.add_row(
            str(r["rank"]),
            *(f"{b[m] / 1e6:.3f}" for m in MODES),
            *(f"{s[m]:.4f}" for m in MODES),
            f"{r['ratios']['merged_over_adapter_seconds']:.1f}x",
            f"{r['probe_max_logprob_diff']:.1e}",
        )
    console.print(table)
    console.print(
        f"[dim]{env['date']} {env['cpu']} x{env['cores']} torch {env['torch']} load {env['load_avg_at_start']}; "
        f"medians of {a['repeat']} rounds; ratios are medians of per-round ratios; bitwise check off; adapter "
        f"parts (rank 0): {', '.join(f'{k} {v:.4f} s' for k, v in report['ranks'][0]['adapter_parts_seconds'].items())}"
        "[/dim]"
    )


def _rank_main(args: argparse.Namespace, workdir: Path, model_dir: str | None) -> int:
    result = run_rank(args, model_dir)
    (workdir / f"rank{result['rank']}.json").write_text(json.dumps(result))
    return 0


def main(args: argparse.Namespace, environment: dict) -> int:
    """The ``--lora-rank`` mode of bench/sync.py: launch the config's ranks, gather their reports."""
    import sys

    from pacs_megatron.launch.local import on_ranks

    if not args.config:
        raise SystemExit("bench.sync --lora-rank needs --config (the run whose model and layout to use)")
    if args.workdir:  # one rank of the job started below
        workdir = Path(args.workdir)
        written = workdir / "model"  # the tiny model the launching process wrote, if any
        return _rank_main(args, workdir, str(written) if written.is_dir() else None)
    cfg = _config(args, None)
    with tempfile.TemporaryDirectory(prefix="pacs_lora_sync_bench_") as tmp:
        workdir = Path(tmp)
        model_dir: str | None = None
        if cfg.model.init == "tiny":  # the CPU default's model: config and tokenizer, random weights
            from pacs_megatron.data.synthetic import write_tiny_model_dir

            model_dir = str(write_tiny_model_dir(workdir / "model", cfg.model.tiny))
        world = cfg.parallel.world_size
        argv = ["pacs_megatron.bench.sync", *sys.argv[1:], "--workdir", str(workdir)]
        code = on_ranks(argv, world, lambda: _rank_main(args, workdir, model_dir))
        if code:
            return code
        ranks = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]
    sets = " ".join(f"--set {x}" for x in args.set)
    environment["command"] = (  # the flags this mode reads (bench/sync.py's shape flags do not apply)
        f"python -m pacs_megatron.bench.sync --lora-rank {args.lora_rank} --config {args.config} {sets} "
        f"--repeat {args.repeat}" + (f" --json {args.json}" if args.json else "")
    ).replace("  ", " ")
    report = {
        "environment": environment,
        "args": {k: v for k, v in vars(args).items() if k != "workdir"},
        "ranks": ranks,
    }
    _print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
