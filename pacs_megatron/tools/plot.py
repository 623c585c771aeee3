"""``pacs-megatron plot OUTPUT_DIR [OUTPUT_DIR ...]``: PNG curves from ``metrics.jsonl``.

One run: a grid of the main curves -> ``OUTPUT_DIR/plots/curves.png``. Several runs: the same keys
overlaid, one line per run (e.g. PACS vs GRPO on the same seeds) -> ``--out`` (required then).

Keys may be glob patterns (``val/*/pass@*``: validation pass@k of every set, drawn by default).
A curve that is constant in every run is dropped and named in the log: in the default PACS recipe
(one update per step) the in-update ``pacs/loss`` and ``pacs/psi_abs_mean`` are ln 2 and 0 by
construction, and the post-update ``pacs/post_*`` curves (see ``pacs_megatron.diagnostics``) are the
ones that move. ``--keep-constant`` draws them anyway.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
from pathlib import Path

from pacs_megatron.utils.logging import get_logger, init_logging

logger = get_logger(__name__)

DEFAULT_KEYS = (
    "reward/mean",
    "val/*/pass@*",
    "pacs/post_loss",
    "pacs/post_classifier_acc",
    "pacs/post_psi_abs_mean",
    "pacs/loss",
    "policy/loss",
    "pacs/psi_abs_mean",
    "data/mixed_group_frac",
    "response/length_mean",
    "actor/grad_norm",
    "actor/entropy",
    "sync/max_logprob_diff",
    "timing/step_s",
)


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a trainer.output_dir of a run")
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    by_step = {r["step"]: r for r in rows}  # a resumed run may have rewritten steps: the last wins
    return [by_step[s] for s in sorted(by_step)]


def select_keys(runs: dict[str, list[dict]], patterns: list[str], keep_constant: bool = False) -> list[str]:
    """The numeric keys matching ``patterns`` (globs allowed), in pattern order; curves that never
    change in any run are dropped (logged) unless ``keep_constant``.

    Example:
        >>> rows = [{"step": 1, "a": 1.0, "val/x/pass@1": 0.1}, {"step": 2, "a": 1.0, "val/x/pass@1": 0.3}]
        >>> select_keys({"run": rows}, ["a", "val/*/pass@*"])
        ['val/x/pass@1']
    """
    present: dict[str, None] = {}
    for rows in runs.values():
        for r in rows:
            present.update((k, None) for k, v in r.items() if k != "step" and isinstance(v, (int, float)))
    keys = list(dict.fromkeys(k for p in patterns for k in sorted(present) if fnmatch.fnmatchcase(k, p)))
    if keep_constant:
        return keys
    constant = [k for k in keys if all(_is_constant(rows, k) for rows in runs.values())]
    if constant:
        logger.info("not drawn, constant in every run: %s (--keep-constant draws them)", ", ".join(constant))
    return [k for k in keys if k not in constant]


def _is_constant(rows: list[dict], key: str) -> bool:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return len(values) > 1 and max(values) - min(values) <= 1e-9 * max(1.0, abs(values[0]))


def plot_runs(
    runs: dict[str, list[dict]], keys: list[str], out: Path, title: str = "", keep_constant: bool = False
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = select_keys(runs, keys, keep_constant)
    if not keys:
        raise ValueError("none of the requested metric keys is present (and changing) in the runs")
    cols = min(3, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.2 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for label, rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), label=label, linewidth=1.4)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run output dirs (trainer.output_dir); several are overlaid")
    p.add_argument("--keys", default=",".join(DEFAULT_KEYS), help="comma-separated metric keys (globs allowed)")
    p.add_argument("--labels", default="", help="comma-separated legend labels (default: dir names)")
    p.add_argument("--out", default="", help="PNG path (default: RUN/plots/curves.png for one run)")
    p.add_argument("--title", default="")
    p.add_argument("--keep-constant", action="store_true", help="also draw curves that never change")


def main(args: argparse.Namespace) -> int:
    init_logging()
    labels = args.labels.split(",") if args.labels else [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        logger.error("--labels has %d names for %d runs", len(labels), len(args.runs))
        return 2
    if len(args.runs) > 1 and not args.out:
        logger.error("several runs: pass --out FILE.png")
        return 2
    out = Path(args.out) if args.out else Path(args.runs[0]) / "plots" / "curves.png"
    runs = {label: read_metrics(r) for label, r in zip(labels, args.runs)}
    plot_runs(runs, [k for k in args.keys.split(",") if k], out, args.title, args.keep_constant)
    logger.info("wrote %s", out)
    return 0
