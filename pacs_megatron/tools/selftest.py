"""``pacs-megatron selftest [--out DIR] [--quick] [--only a,b]``: is this machine's install sound?

One command for a new machine or cluster node, and the project's GPU acceptance run. It runs the named
checks of tools/selftest_checks.py in order (extension, fused op vs the fp64 reference, kernel
benchmarks, Megatron vs HF parity, a short training run, the weight-sync benchmark), each ending as

    pass | fail | skip   + the reason (skip, fail) and its figure (errors, GB/s, s/step, ...)

prints a table, writes ``DIR/selftest.json`` (machine-readable: every check's status, figure, data,
seconds, plus the environment) and ``DIR/selftest.md`` (a short summary to paste into an issue or
docs/benchmarks.md), keeps each subprocess log in ``DIR``, and exits 1 if any check failed (skips do
not fail: a CPU-only machine runs the CPU subset and lists the GPU checks as skipped, with why).
``--quick`` shrinks the benchmarks and the training run (the CI test runs it on CPU, ~1-2 min).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
import traceback
from pathlib import Path

from pacs_megatron.config import ConfigError
from pacs_megatron.tools.selftest_checks import CHECKS, Context, Skip
from pacs_megatron.utils.logging import get_logger, init_logging
from pacs_megatron.utils.paths import check_writable_dir

logger = get_logger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="outputs/selftest", help="directory for selftest.json, selftest.md and logs")
    p.add_argument("--quick", action="store_true", help="smaller benchmarks and a 3-step training run")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(CHECKS)}")


def _environment() -> dict:
    import torch  # here, not at the top: `selftest --help` imports no torch

    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cores": os.cpu_count(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def run_checks(ctx: Context, names: list[str]) -> list[dict]:
    """Run ``names`` in order; one dict per check (a failing check never stops the others)."""
    results = []
    for name in names:
        fn, gpu, what = CHECKS[name]
        t0 = time.perf_counter()
        rec = {"name": name, "gpu": gpu, "what": what, "status": "pass", "reason": "", "figure": "", "data": {}}
        try:
            out = fn(ctx)
            rec.update(status="pass" if out.ok else "fail", figure=out.figure, data=out.data)
            if not out.ok:
                rec["reason"] = "below its threshold (see figure)"
        except Skip as e:
            rec.update(status="skip", reason=str(e))
        except Exception as e:  # a check's crash is its failure, reported with the traceback in the JSON
            rec.update(status="fail", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        logger.info("selftest %-22s %s %s %s", name, rec["status"].upper(), rec["figure"], rec["reason"])
        results.append(rec)
    return results


def _markdown(report: dict) -> str:
    env = report["environment"]
    gpus = ", ".join(env.get("gpus", [])) or "no GPU"
    lines = [
        f"### selftest {env['date']} on {env['host']} ({gpus}; torch {env['torch']}, {env['cores']} cores)",
        "",
        "| check | status | figure / reason | s |",
        "|---|---|---|---|",
    ]
    for r in report["checks"]:
        text = r["figure"] if r["status"] == "pass" else (r["reason"] + (f"; {r['figure']}" if r["figure"] else ""))
        cell = text.replace("|", "\\|")  # a literal | inside a markdown table cell
        lines.append(f"| {r['name']} | {r['status']} | {cell} | {r['seconds']:.1f} |")
    c = report["counts"]
    lines += [
        "",
        f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped ({'quick' if report['quick'] else 'full'})",
    ]
    return "\n".join(lines) + "\n"


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    style = {"pass": "green", "fail": "bold red", "skip": "yellow"}
    table = Table(title=f"pacs-megatron selftest ({'quick' if report['quick'] else 'full'})")
    for col in ("check", "status", "figure / reason", "s"):
        table.add_column(col, justify="right" if col == "s" else "left")
    for r in report["checks"]:
        text = r["figure"] if r["status"] == "pass" else " ".join(filter(None, [r["reason"], r["figure"]]))
        table.add_row(r["name"], f"[{style[r['status']]}]{r['status']}[/]", text, f"{r['seconds']:.1f}")
    Console(stderr=True).print(table)


def main(args: argparse.Namespace) -> int:
    init_logging()
    names = list(CHECKS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise ConfigError(f"--only {args.only!r}: unknown check(s) {unknown}; choose from {list(CHECKS)}")
    check_writable_dir("--out", args.out)  # before the checks run: their report must have a place
    out = Path(args.out).resolve()
    (out / "work").mkdir(parents=True, exist_ok=True)
    report = {"environment": _environment(), "quick": bool(args.quick)}
    report["checks"] = run_checks(Context(out=out, quick=bool(args.quick)), names)
    report["counts"] = {s: sum(r["status"] == s for r in report["checks"]) for s in ("pass", "fail", "skip")}
    (out / "selftest.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "selftest.md").write_text(_markdown(report))
    _print_table(report)
    logger.info("selftest report: %s (and selftest.md)", out / "selftest.json")
    return 1 if report["counts"]["fail"] else 0
