"""Benchmark: one RL step of this project beside TRL's GRPOTrainer on the same real model, in one run.

    python -m pacs_megatron.bench.rl_step --model HF_DIR                       # fp32 and bf16, both trainers
    python -m pacs_megatron.bench.rl_step --model HF_DIR --dtypes bfloat16 --rounds 3 --json rl_step.json
    python -m pacs_megatron.bench.rl_step --model HF_DIR --trainers ours --ours parallel.dp=2   # a layout
    python -m pacs_megatron.bench.rl_step --model HF_DIR --trainers ours \
        --arm fused:model.fused_lm_head=true --arm unfused:model.fused_lm_head=false   # a switch, before/after

Both trainers get the same raw prompts in the same order; every (trainer, dtype) is a fresh process whose
first step is a warm-up, and rounds alternate the variants' order. TRL comes from the ``bench-trl`` extra
(bench/trl_step.py). Printed per variant: stage times, tokens/s against TRL, the fraction of the matmul
floor, peak RSS and bytes per token in flight. Their definitions and results: docs/benchmarks.md,
"This project's step beside TRL's".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from pacs_megatron.run.layout import RunLayout
from pacs_megatron.utils.logging import get_logger, init_logging

logger = get_logger("pacs_megatron.bench.rl_step")  # also when run as __main__
BYTES = {"float32": 4, "bfloat16": 2}
STAGES = {"ours": ("rollout", "old_logprob", "update", "sync"), "trl": ("generate", "score", "update")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("PACS_BENCH_MODEL"), help="HF model directory (or env)")
    p.add_argument("--trainers", default="ours,trl", help="comma-separated of ours, trl")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated of float32, bfloat16")
    p.add_argument("--loss", default="grpo", help="ours: algorithm.loss (pacs or grpo); TRL runs GRPO")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is a warm-up")
    p.add_argument("--rounds", type=int, default=2, help="runs of every variant, in alternating order")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads of a whole run")
    p.add_argument("--ours", nargs="*", default=[], help="extra a.b=c overrides of our trainer's config")
    p.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="LABEL:a.b=c[,a.b=c]",
        help="our trainer once more per arm, with these overrides on top of --ours (repeatable); the arms run "
        "in the same alternating rounds, so a switch is measured before/after side by side",
    )
    p.add_argument("--floor-tokens", type=int, default=2048, help="rows of the floor's GEMMs")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")


# ------------------------------------------------------------------------------------------ the work


def write_prompts(path: Path, count: int, seed: int = 0) -> list[dict]:
    """``count`` two-digit sums with the PACS instruction (the text both trainers get), as JSONL rows in
    the schema of data/sources.py plus the rendered ``prompt``."""
    from pacs_megatron.data.prompts import with_instruction

    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        problem = f"What is {a} + {b}?"
        rows.append({"id": f"sum-{i}", "problem": problem, "answer": str(a + b), "prompt": with_instruction(problem)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def matmul_params(model_dir: str) -> int:
    """P: weights that take part in a matmul per token (every layer's linear weights and the LM head)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    h, layers, v = c.hidden_size, c.num_hidden_layers, c.vocab_size
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    attn = h * d * (c.num_attention_heads + 2 * kv) + c.num_attention_heads * d * h
    return layers * (attn + 3 * h * c.intermediate_size) + v * h


def gemm_shapes(model_dir: str, tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of the model's linear layers on ``tokens`` rows."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    h = c.hidden_size
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    q = c.num_attention_heads * d
    return [(tokens, h, q + 2 * kv * d), (tokens, q, h), (tokens, h, 2 * c.intermediate_size),
            (tokens, c.intermediate_size, h), (tokens, h, c.vocab_size)]  # fmt: skip


def matmul_floor(shapes: list[tuple[int, int, int]], dtype: torch.dtype, threads: int, seconds: float = 1.0) -> float:
    """FLOP/s of ``torch.matmul`` over ``shapes`` (FLOP-weighted: total FLOPs / total time, best of the
    repeats per shape) with ``threads`` threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops, spent = 0.0, 0.0
        for m, k, n in shapes:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            torch.matmul(a, b)  # warm-up (packing, thread pool)
            best, start = float("inf"), time.perf_counter()
            while time.perf_counter() - start < seconds / len(shapes):
                t = time.perf_counter()
                torch.matmul(a, b)
                best = min(best, time.perf_counter() - t)
            flops += 2.0 * m * k * n
            spent += best
        return flops / spent
    finally:
        torch.set_num_threads(old)


# ------------------------------------------------------------------------------------------ the runs


def _layout(overrides: list[str]) -> dict[str, int]:
    """tp, pp, dp named in ``--ours`` overrides (1 otherwise)."""
    out = {"tp": 1, "pp": 1, "dp": 1}
    for o in overrides:
        key, _, val = o.partition("=")
        if key.removeprefix("parallel.") in out and key.startswith("parallel."):
            out[key.removeprefix("parallel.")] = int(val)
    return out


def parse_arms(specs: list[str]) -> dict[str, list[str]]:
    """``--arm`` values as {"ours/LABEL": overrides}; no arm gives the plain trainer.

    Example:
        >>> parse_arms(["fused:model.fused_lm_head=true,rollout.n=4"])
        {'ours/fused': ['model.fused_lm_head=true', 'rollout.n=4']}
        >>> parse_arms([])
        {'ours': []}
    """
    arms: dict[str, list[str]] = {}
    for spec in specs:
        label, sep, overrides = spec.partition(":")
        if not sep or not label or "=" not in overrides:
            raise SystemExit(f"--arm {spec!r}: give LABEL:a.b=c[,a.b=c] (e.g. fused:model.fused_lm_head=true)")
        arms[f"ours/{label}"] = overrides.split(",")
    return arms or {"ours": []}


def _ours_config(args, dtype: str, prompts_file: Path, out: Path) -> dict:
    rows = args.prompts * args.n // _layout(args.ours)["dp"]  # one micro-batch per rank
    return {
        "model": {"path": args.model, "init": "pretrained", "dtype": dtype},
        "parallel": {"tp": 1, "pp": 1, "dp": 1},
        "rollout": {"engine": "hf", "n": args.n, "temperature": 1.0, "max_response_length": args.max_tokens},
        "algorithm": {"loss": args.loss, "mini_batch_size": 0, "micro_batch_size": rows},
        "optimizer": {"lr": args.lr, "weight_decay": 0.0, "clip_grad": 1.0},
        "data": {
            "task": "math",
            "train_files": [str(prompts_file)],
            "val_files": [],
            "chat_template": "none",
            "max_prompt_length": 64,
            "shuffle": False,
        },
        "reward": {"fn": "math", "num_workers": 1},
        "trainer": {"total_steps": args.steps, "train_batch_size": args.prompts, "output_dir": str(out)},
        "logging": {"tensorboard": False, "progress_bar": False, "post_update_metrics": False},
    }


def _env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def run_ours(args, dtype: str, work: Path, prompts_file: Path, arm: Sequence[str] = ()) -> list[dict]:
    """Our trainer's steps (``pacs-megatron train``, local ranks, ``--ours`` then the arm's overrides), from
    its metrics.jsonl."""
    import yaml

    out = work / "out"
    cfg = work / "config.yaml"
    cfg.write_text(yaml.safe_dump(_ours_config(args, dtype, prompts_file, out)))
    cmd = [sys.executable, "-m", "pacs_megatron", "train", "--config", str(cfg), "--resume", "never", *args.ours]
    cmd += list(arm)
    world = 1
    for size in _layout(args.ours).values():
        world *= size
    env = _env(max(1, args.threads // world))  # --threads split over the local ranks
    with (work / "train.log").open("w") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    records = []
    for line in RunLayout(out).metrics.read_text().splitlines():
        m = json.loads(line)
        rec = {"step": m["step"], "tokens": m["data/tokens"], "step_s": m["timing/step_s"]}
        rec["rank_tokens"] = m["data/tokens"] / _layout(args.ours)["dp"]  # what rank 0 trains on
        rec["step_cpu_s"] = sum(v for k, v in m.items() if k.startswith("timing/") and k.endswith("_cpu_s"))
        for stage in STAGES["ours"]:
            rec[f"{stage}_s"] = m.get(f"timing/{stage}_s", 0.0)
        rec["peak_rss_gb"] = [v for k, v in sorted(m.items()) if k.startswith("perf/peak_rss_gb_rank")]
        rec["step_rss_gb"] = m.get("perf/step_rss_gb_rank0", float("nan"))
        records.append(rec)
    return records


def run_trl(args, dtype: str, work: Path, prompts_file: Path) -> list[dict]:
    """TRL's steps (bench/trl_step.py in a child process)."""
    out = work / "trl.json"
    cmd = [sys.executable, "-m", "pacs_megatron.bench.trl_step", "--model", args.model, "--prompts", str(prompts_file)]
    cmd += ["--steps", str(args.steps), "--n", str(args.n), "--prompts-per-step", str(args.prompts)]
    cmd += ["--max-tokens", str(args.max_tokens), "--lr", str(args.lr), "--dtype", dtype, "--out", str(out)]
    with (work / "trl.log").open("w") as log:
        subprocess.run(cmd, check=True, env=_env(args.threads), stdout=log, stderr=subprocess.STDOUT)
    records = json.loads(out.read_text())
    for r in records:
        r["score_s"] = r.get("rollout_s", 0.0) - r.get("generate_s", 0.0)
        r["update_s"] = r["step_s"] - r.get("rollout_s", 0.0)
        r["peak_rss_gb"] = [r["peak_rss_gb"]]
        r["rank_tokens"] = r["tokens"]
    return records


# ------------------------------------------------------------------------------------------ the report


def step_flops(p_mm: int, tokens: float, prompt_tokens: float, n: int) -> float:
    """Model FLOPs of a step of ``tokens`` (prompt + completion over all samples) whose distinct prompts hold
    ``prompt_tokens``: sampling (one prefill per prompt, one token per generated token) and the update.

    Example:
        >>> step_flops(1, tokens=100, prompt_tokens=10, n=8)  # 20 generated tokens
        660.0
    """
    generated = tokens - n * prompt_tokens
    return 2.0 * p_mm * (prompt_tokens + generated) + 6.0 * p_mm * tokens


def summarize(records: list[dict], trainer: str, dtype: str, flops_of, floor: float) -> dict:
    """Medians over the counted steps of one variant (all rounds); ``flops_of(tokens)`` is the step's work."""
    med = lambda key: statistics.median(r[key] for r in records)  # noqa: E731
    tokens = med("tokens")
    step = med("step_s")
    flops = flops_of(tokens)
    return {
        "trainer": trainer,
        "dtype": dtype,
        "steps": len(records),
        "step_s": step,
        "step_cpu_s": med("step_cpu_s"),
        "stages_s": {s: med(f"{s}_s") for s in STAGES[trainer.split("/")[0]]},
        "tokens": tokens,
        "tokens_per_s": statistics.median(r["tokens"] / r["step_s"] for r in records),
        "model_tflop": flops / 1e12,
        "floor_fraction": flops / step / floor,
        "peak_rss_gb": [max(r["peak_rss_gb"][i] for r in records) for i in range(len(records[0]["peak_rss_gb"]))],
        "step_rss_gb": med("step_rss_gb"),
        "bytes_per_token": med("step_rss_gb") * 1e9 / med("rank_tokens"),
    }


def report(rows: list[dict], floors: dict, vocab: int, console) -> None:
    from rich.table import Table

    trl = {r["dtype"]: r["tokens_per_s"] for r in rows if r["trainer"] == "trl"}
    table = Table(title="one RL step, medians (wall seconds; CPU seconds of the process beside the step)")
    cols: tuple[str, ...] = (
        "trainer",
        "dtype",
        "stages s",
        "step s",
        "cpu s",
        "tokens",
        "tok/s",
        "x TRL same",
        "x TRL fp32",
    )
    cols += ("floor frac", "peak RSS GB/rank", "bytes/token", "V-buffers/token")
    for c in cols:
        table.add_column(c, justify="right")
    for r in rows:
        same, f32 = trl.get(r["dtype"]), trl.get("float32")
        stages = " ".join(f"{k} {v:.1f}" for k, v in r["stages_s"].items())
        table.add_row(
            r["trainer"],
            r["dtype"],
            stages,
            f"{r['step_s']:.1f}",
            f"{r['step_cpu_s']:.1f}",
            f"{r['tokens']:.0f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['tokens_per_s'] / same:.2f}" if same else "-",
            f"{r['tokens_per_s'] / f32:.2f}" if f32 else "-",
            f"{r['floor_fraction']:.2f}",
            " ".join(f"{x:.1f}" for x in r["peak_rss_gb"]),
            f"{r['bytes_per_token'] / 1e6:.2f} MB",
            f"{r['bytes_per_token'] / (vocab * BYTES[r['dtype']]):.1f}",
        )
    console.print(table)
    console.print("matmul floor: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in floors.items()))


def main(args: argparse.Namespace) -> int:
    init_logging()
    from rich.console import Console
    from transformers import AutoConfig, AutoTokenizer

    if not args.model or not Path(args.model, "config.json").is_file():
        raise SystemExit(f"--model {args.model!r}: give a Hugging Face model directory (config.json, weights)")
    arms = parse_arms(args.arm)
    trainers = [a for t in args.trainers.split(",") for a in (arms if t == "ours" else [t])]
    dtypes = args.dtypes.split(",")
    if "trl" in trainers:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit('TRL is not installed: pip install -e ".[bench-trl]" (or --trainers ours)') from None
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    p_mm = matmul_params(args.model)
    shapes = gemm_shapes(args.model, args.floor_tokens)
    floors = {d: matmul_floor(shapes, getattr(torch, d), args.threads) for d in dtypes}
    logger.info("matmul floor: %s", {k: f"{v / 1e9:.0f} GFLOP/s" for k, v in floors.items()})
    root = Path(args.workdir or tempfile.mkdtemp(prefix="pacs_rl_step_"))
    root.mkdir(parents=True, exist_ok=True)
    rows_file = root / "prompts.jsonl"
    prompts = write_prompts(rows_file, args.prompts * args.steps)
    tok = AutoTokenizer.from_pretrained(args.model)
    per_step = [
        sum(len(tok(p["prompt"], add_special_tokens=False)["input_ids"]) for p in prompts[i : i + args.prompts])
        for i in range(0, len(prompts), args.prompts)
    ]
    variants = [(t, d) for d in dtypes for t in trainers]
    results: dict[tuple[str, str], list[dict]] = {v: [] for v in variants}
    for rnd in range(args.rounds):
        for trainer, dtype in variants if rnd % 2 == 0 else variants[::-1]:
            work = root / f"round{rnd}_{trainer.replace('/', '_')}_{dtype}"
            work.mkdir(parents=True, exist_ok=True)
            logger.info("round %d: %s %s", rnd, trainer, dtype)
            if trainer == "trl":
                records = run_trl(args, dtype, work, rows_file)
            else:
                records = run_ours(args, dtype, work, rows_file, arms[trainer])
            results[(trainer, dtype)] += [r for r in records if r["step"] > 1]  # step 1: warm-up
    prompt_tokens = statistics.median(per_step[1:] or per_step)  # the counted steps' distinct prompts
    flops_of = lambda tokens: step_flops(p_mm, tokens, prompt_tokens, args.n)  # noqa: E731
    rows = [summarize(results[v], *v, flops_of, floors[v[1]]) for v in variants]
    report(rows, floors, vocab, Console(width=None if sys.stdout.isatty() else 220))  # a log file: no 80-col wrap
    if args.json:
        meta = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "args": {k: v for k, v in vars(args).items()},
            "matmul_params": p_mm,
            "floor_flops": floors,
            "workdir": str(root),
        }
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pacs_megatron.bench.rl_step", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
