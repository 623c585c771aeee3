"""Benchmark: fused log-prob op vs naive torch vs megatron-core's vocab_parallel_cross_entropy, side by side.

    python -m pacs_megatron.bench.logprob --device cpu --shapes 4096x32768 --dtype float32 --threads 2 --json out.json

For each N x V shape (one rank's shard under ``--tp W``) it times forward and forward+backward of
- fused      ``fused_logprobs(x, t, mask, temperature=T).seq_logp`` (fresh gradient buffer)
- fused-ip   the same with ``inplace_backward=True`` (gradient written into the logits buffer)
- naive      ``log_softmax(x / T).gather`` + masked sum, torch autograd
- megatron   ``-vocab_parallel_cross_entropy(x / T, t)`` + masked sum (TP=1 group on a one-process world)
and the peak extra memory of one forward+backward (CPU: VmHWM reset through /proc/self/clear_refs; CUDA: the
allocator's peak, plus GB/s against the card's HBM floor). ``--head H`` adds the fused LM head's rows
(bench/head.py). Method and results: docs/benchmarks.md, "Fused log-prob kernel".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import threading
import time

import torch

from pacs_megatron.ops import fused_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Datasheet HBM peaks (TB/s), matched in order against torch.cuda.get_device_name: the floor is per card
# (one card's peak misgrades another's kernel: docs/benchmarks.md, "GPU: the H200 runs of 2026-11-26").
HBM_PEAK_TBPS: tuple[tuple[str, float | None], ...] = (
    ("GH200", None),  # 4.0 (HBM3) or 4.9 TB/s (HBM3e) by model: give --hbm-tbps
    ("H200", 4.8),
    ("H100 PCIe", 2.0),
    ("H100 NVL", 3.9),
    ("H100", 3.35),  # SXM, "NVIDIA H100 80GB HBM3"
    ("A100 80GB PCIe", 1.935),
    ("A100-SXM4-80GB", 2.039),
    ("A100", 1.555),  # 40 GB
    ("B200", 8.0),
)


def hbm_peak_tbps(device_name: str) -> float | None:
    """The card's HBM peak from its name, or None for a card not in ``HBM_PEAK_TBPS`` (give --hbm-tbps)."""
    for key, tbps in HBM_PEAK_TBPS:
        if key in device_name:
            return tbps
    return None


def _hbm_floor_tbps(args, device) -> float | None:
    """--hbm-tbps when given, else the card's own peak; None: no % of floor is reported."""
    return args.hbm_tbps or hbm_peak_tbps(torch.cuda.get_device_name(device))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default="4096x32768", help="comma-separated NxV (rows x vocab): 4096x32768,512x152064")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--tp", type=int, default=1, help="simulate TP: time one rank's [N, V/tp] shard")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions after one warm-up (median reported)")
    p.add_argument("--candidates", default="fused,fused-ip,naive,megatron")
    p.add_argument(
        "--hbm-tbps", type=float, default=None, help="HBM peak (TB/s) for the %% of floor; default: from the GPU's name"
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--head", type=int, default=None, help="hidden size H: also bench the fused LM head (bench/head.py)")
    p.add_argument("--head-candidates", default="head-fused,head+fused,head+naive")
    p.add_argument("--block-cols", type=int, default=None, help="vocab columns per block of head-fused (default: auto)")
    p.add_argument("--no-logits-rows", action="store_true", help="with --head: skip the logits-input rows")


# ---------------------------------------------------------------- memory probes


class _PeakMemory:
    """Peak extra memory (bytes) over the state at __enter__; see the module docstring for the methods."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0
        self.method = "cuda.max_memory_allocated" if device.type == "cuda" else _cpu_method()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.method == "rss-hwm":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = _status_kb("VmRSS") * 1024
        else:
            import psutil

            proc, self._stop, self._max = psutil.Process(), threading.Event(), 0
            self.base = proc.memory_info().rss

            def poll():
                while not self._stop.is_set():
                    self._max = max(self._max, proc.memory_info().rss)
                    time.sleep(0.001)

            self._thread = threading.Thread(target=poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        elif self.method == "rss-hwm":
            self.peak = _status_kb("VmHWM") * 1024 - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = self._max - self.base


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1))


def _cpu_method() -> str:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status_kb("VmHWM")
        return "rss-hwm"
    except OSError:
        return "rss-poll-1ms"


# ---------------------------------------------------------------- candidates


def _megatron_ready(device: torch.device) -> str | None:
    """Initialise a one-process world + TP=1 for megatron; returns why not, or None."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state

        if not dist.is_initialized():
            from pacs_megatron.utils.dist import free_port

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        return None
    except Exception as e:  # a benchmark row, not a failure
        return f"{type(e).__name__}: {e}"


def _candidate(name: str, temperature: float):
    """fn(x, targets, mask) -> scalar loss (masked sum of log-probs)."""
    if name in ("fused", "fused-ip"):
        inplace = name == "fused-ip"
        return lambda x, t, m: fused_logprobs(
            x, t, m, temperature=temperature, inplace_backward=inplace, impl="ext"
        ).seq_logp.sum()
    if name == "naive":

        def naive(x, t, m):
            logp = torch.log_softmax(x / temperature, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
            return torch.where(m, logp, torch.zeros_like(logp)).sum()

        return naive
    if name == "megatron":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        def mega(x, t, m):
            logp = -vocab_parallel_cross_entropy(x / temperature, t)  # x / T is a fresh tensor it may overwrite
            return torch.where(m, logp, torch.zeros_like(logp)).sum()

        return mega
    raise ValueError(f"--candidates: unknown {name!r} (use fused, fused-ip, naive, megatron)")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_one(fn, logits, targets, mask, *, backward: bool, fresh_copy: bool, device) -> tuple[float, int]:
    x = (logits.clone() if fresh_copy else logits).requires_grad_(backward)  # in-place runs destroy their input
    _sync(device)
    with _PeakMemory(device) as mem:
        t0 = time.perf_counter()
        loss = fn(x, targets, mask)
        if backward:
            (grad,) = torch.autograd.grad(loss, [x])
            del grad
        _sync(device)
        elapsed = time.perf_counter() - t0
        del loss
    return elapsed, mem.peak


def bench_shape(n: int, v: int, args, device, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, n, v, generator=gen).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (1, n), generator=gen).to(device)
    mask = (torch.rand(1, n, generator=gen) > 0.2).to(device)
    row = {"N": n, "V": v, "dtype": args.dtype, "candidates": {}}
    for name in args.candidates.split(","):
        if name == "megatron" and (why := _megatron_ready(device)) is not None:
            row["candidates"][name] = {"skipped": why}
            continue
        fn = _candidate(name, args.temperature)
        res = {}
        for mode, backward in (("fwd", False), ("fwd_bwd", True)):
            if name == "fused-ip" and not backward:
                continue  # identical to fused
            runs = [
                _time_one(fn, logits, targets, mask, backward=backward, fresh_copy=True, device=device)
                for _ in range(args.repeat + 1)
            ][1:]
            res[f"{mode}_ms"] = 1e3 * statistics.median(r[0] for r in runs)
            res[f"{mode}_peak_extra_mb"] = max(r[1] for r in runs) / 2**20
        if device.type == "cuda" and name.startswith("fused"):
            peak = _hbm_floor_tbps(args, device)
            elt = logits.element_size()
            for mode, reads_writes in (("fwd", 1), ("fwd_bwd", 3)):
                if f"{mode}_ms" in res:
                    gbps = reads_writes * n * v * elt / (res[f"{mode}_ms"] / 1e3) / 1e9
                    res[f"{mode}_gbps"] = gbps
                    if peak:
                        res[f"{mode}_pct_hbm_floor"] = 100 * gbps / (peak * 1e3)
        row["candidates"][name] = res
    c = row["candidates"]
    if "fused" in c and "naive" in c:
        row["speedup_vs_naive"] = {m: c["naive"][f"{m}_ms"] / c["fused"][f"{m}_ms"] for m in ("fwd", "fwd_bwd")}
        row["mem_ratio_vs_naive"] = {
            k: c[k]["fwd_bwd_peak_extra_mb"] / max(c["naive"]["fwd_bwd_peak_extra_mb"], 1e-9)
            for k in ("fused", "fused-ip")
            if k in c
        }
    if "fused" in c and "megatron" in c and "fwd_ms" in c["megatron"]:
        row["speedup_vs_megatron"] = {m: c["megatron"][f"{m}_ms"] / c["fused"][f"{m}_ms"] for m in ("fwd", "fwd_bwd")}
    return row


def _environment(args, device) -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    env = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_avg_at_start": load,
        "device": str(device),
        "tp_simulated": args.tp,
        "temperature": args.temperature,
        "memory_method": _PeakMemory(device).method,
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["hbm_peak_tbps"] = _hbm_floor_tbps(args, device)
    return env


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for row in report["results"]:
        table = Table(title=f"N={row['N']} V={row['V']} {row['dtype']} ({report['environment']['device']})")
        for col in ("candidate", "fwd ms", "fwd+bwd ms", "fwd+bwd peak extra MB", "GB/s fwd+bwd", "% HBM floor"):
            table.add_column(col, justify="right")
        for name, res in row["candidates"].items():
            if "skipped" in res:
                table.add_row(name, "skipped", res["skipped"][:60], "", "", "")
                continue
            cells = [
                ("fwd_ms", "{:.1f}"),
                ("fwd_bwd_ms", "{:.1f}"),
                ("fwd_bwd_peak_extra_mb", "{:.0f}"),
                ("fwd_bwd_gbps", "{:.0f}"),
                ("fwd_bwd_pct_hbm_floor", "{:.0f}%"),
            ]
            table.add_row(name, *(f.format(res[k]) if k in res else "-" for k, f in cells))
        console.print(table)
        for key in ("speedup_vs_naive", "mem_ratio_vs_naive", "speedup_vs_megatron"):
            if key in row:
                console.print(f"  {key}: " + ", ".join(f"{k} {v:.2f}x" for k, v in row[key].items()))
    env = report["environment"]
    console.print(
        f"[dim]{env['date']} {env['cpu']} x{env['cores']} torch {env['torch']} threads {env['threads']} "
        f"load {env['load_avg_at_start']} memory: {env['memory_method']}[/dim]"
    )


def main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    shapes = []
    for item in args.shapes.split(","):
        n, v = (int(s) for s in item.lower().split("x"))
        if v % args.tp:
            raise ValueError(f"--shapes {item}: V={v} is not divisible by --tp {args.tp}")
        shapes.append((n, v // args.tp))
    report = {
        "environment": _environment(args, device),
        "command": "python -m pacs_megatron.bench.logprob "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "results": [] if args.no_logits_rows else [bench_shape(n, v, args, device, dtype) for n, v in shapes],
    }
    if report["results"]:
        _print_table(report)
    if args.head:
        from pacs_megatron.bench.head import bench_head_shape, print_head_table

        report["head_results"] = [
            bench_head_shape(n, v, args.head, args, device, dtype, _PeakMemory) for n, v in shapes
        ]
        for row in report["head_results"]:
            print_head_table(row, str(device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
