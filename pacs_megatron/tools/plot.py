"""``pacs-megatron plot OUTPUT_DIR [OUTPUT_DIR ...]``: PNG curves from ``metrics.jsonl``.

One run: a grid of the main curves -> ``OUTPUT_DIR/plots/curves.png``. Several runs: the same keys
overlaid, one line per run (e.g. PACS vs GRPO on the same seeds) -> ``--out`` (required then).

Keys may be glob patterns (``val/*/pass@*``: validation pass@k of every set, drawn by default).
A curve that is constant in every run is dropped and named in the log: in the default PACS recipe
(one update per step) the in-update ``pacs/loss`` and ``pacs/psi_abs_mean`` are ln 2 and 0 by
construction, and the post-update ``pacs/post_*`` curves (see ``pacs_megatron.loop.diagnostics``) are the
ones that move. ``--keep-constant`` draws them anyway.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
from pathlib import Path

from pacs_megatron.run.layout import RunLayout
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
    """The rows of ``run_dir/metrics.jsonl`` by step; ConfigError / DataFormatError naming what is wrong."""
    from pacs_megatron.config import ConfigError
    from pacs_megatron.data.records import DataFormatError

    path = RunLayout(Path(run_dir)).metrics
    if not path.is_file():
        what = "does not exist" if not Path(run_dir).exists() else "has no metrics.jsonl"
        raise ConfigError(f"run {run_dir} {what}: pass the trainer.output_dir of a run that has logged a step")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows = []
    for i, ln in enumerate(lines, 1):
        try:
            row = json.loads(ln) if ln.strip() else None
        except ValueError:
            if i == len(lines):  # the last line of a run killed while writing it
                logger.warning("%s:%d: skipped a half-written last line", path, i)
                continue
            raise DataFormatError(f"{path}:{i}: not a JSON object; fix or delete that line") from None
        if row is not None:
            if not isinstance(row, dict) or "step" not in row:
                raise DataFormatError(f"{path}:{i}: not a metrics row (no 'step'); fix or delete that line")
            rows.append(row)
    by_step = {r["step"]: r for r in rows}  # a resumed run may have rewritten steps: the last wins
    return [by_step[s] for s in sorted(by_step)]


def present_keys(runs: dict[str, list[dict]]) -> list[str]:
    """Every numeric metric key logged by any of ``runs``, sorted."""
    present: dict[str, None] = {}
    for rows in runs.values():
        for r in rows:
            present.update((k, None) for k, v in r.items() if k != "step" and isinstance(v, (int, float)))
    return sorted(present)


def check_requested_keys(runs: dict[str, list[dict]], patterns: list[str]) -> None:
    """``--keys`` given by the user: each pattern matches a logged key, or ConfigError naming the closest ones
    (a typo such as ``reward/meen`` would otherwise just leave its panel out).

    Example:
        >>> check_requested_keys({"r": [{"step": 1, "loss/mean": 0.5}]}, ["loss/meen"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        pacs_megatron.config.base.ConfigError: --keys: none of ... (loss/meen: did you mean loss/mean?)
    """
    import difflib

    from pacs_megatron.config import ConfigError

    present = present_keys(runs)
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(k, p) for k in present)]
    if not unmatched:
        return
    pattern = unmatched[0]
    close = difflib.get_close_matches(pattern, present, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else f"logged keys include {', '.join(present[:8])}"
    if len(unmatched) == len(patterns):
        raise ConfigError(f"--keys: none of the requested metric keys is in the runs ({pattern}: {hint})")
    raise ConfigError(f"--keys {pattern}: no such metric in the runs; {hint}")


def select_keys(runs: dict[str, list[dict]], patterns: list[str], keep_constant: bool = False) -> list[str]:
    """The numeric keys matching ``patterns`` (globs allowed), in pattern order; curves that never
    change in any run are dropped (logged) unless ``keep_constant``.

    Example:
        >>> rows = [{"step": 1, "a": 1.0, "val/x/pass@1": 0.1}, {"step": 2, "a": 1.0, "val/x/pass@1": 0.3}]
        >>> select_keys({"run": rows}, ["a", "val/*/pass@*"])
        ['val/x/pass@1']
    """
    present = present_keys(runs)
    keys = list(dict.fromkeys(k for p in patterns for k in present if fnmatch.fnmatchcase(k, p)))
    if keep_constant:
        return keys
    constant = [k for k in keys if all(_is_constant(rows, k) for rows in runs.values())]
    if constant:
        logger.info("not drawn, constant in every run: %s (--keep-constant draws them)", ", ".join(constant))
    return [k for k in keys if k not in constant]


def _is_constant(rows: list[dict], key: str) -> bool:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return len(values) > 1 and max(values) - min(values) <= 1e-9 * max(1.0, abs(values[0]))


def _require_matplotlib() -> None:
    from pacs_megatron.launch.optional_deps import require

    require("plot", "matplotlib", "pip install matplotlib")


def plot_runs(
    runs: dict[str, list[dict]], keys: list[str], out: Path, title: str = "", keep_constant: bool = False
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = select_keys(runs, keys, keep_constant)
    if not keys:
        from pacs_megatron.config import ConfigError

        raise ConfigError(
            "--keys: none of the requested metric keys is present (and changing) in the runs; "
            "see the keys in metrics.jsonl (--keep-constant also draws constant ones)"
        )
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
    from pacs_megatron.config import ConfigError
    from pacs_megatron.utils.paths import check_writable_file

    init_logging()
    labels = args.labels.split(",") if args.labels else [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        raise ConfigError(f"--labels has {len(labels)} names for {len(args.runs)} runs")
    if len(args.runs) > 1 and not args.out:
        raise ConfigError("several runs: pass --out FILE.png")
    out = Path(args.out) if args.out else RunLayout(Path(args.runs[0])).plots / "curves.png"
    runs = {label: read_metrics(r) for label, r in zip(labels, args.runs)}
    check_writable_file("--out", out)
    keys = [k for k in args.keys.split(",") if k]
    if args.keys != ",".join(DEFAULT_KEYS):  # the defaults name curves a run may not log (val/* without test_freq)
        check_requested_keys(runs, keys)
    _require_matplotlib()
    plot_runs(runs, keys, out, args.title, args.keep_constant)
    logger.info("wrote %s", out)
    return 0
