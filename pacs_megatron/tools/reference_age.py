"""PACS v2's classifier against the age of its reference: the measurement that chooses the reset period K.

    python -m pacs_megatron.tools.reference_age docs/results/k_sweep_cpu_default --out docs/results/k_sweep_cpu_default

DIR holds one folder per K (``K2/``, ``K5/``, ``K0/`` for "never reset"), each a ``compare --results`` folder
(a run directory per seed under ``runs/``). Every step's row carries ``reference/age`` (the age of the reference
that step's update measured r against, loop/update_stages.py) and the classifier's Brier score of sigmoid(psi)
against the outcome during the update (``pacs/brier``) and after it (``pacs/post_brier``). Writes
``OUT/k_table.md`` (per K: the run's mean Brier, its reward and validation; per age: the Brier over all K) and
``OUT/brier_by_age.png``; seeds are the unit of every 95% t-interval (a seed's rows of one age are averaged first).
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from pacs_megatron.run.layout import RunLayout
from pacs_megatron.tools.compare.report import _pm, band, find_val_key, finish, interval, series
from pacs_megatron.tools.plot import read_metrics

BRIER, POST, AGE, REWARD = "pacs/brier", "pacs/post_brier", "reference/age", "reward/mean"


def load_sweep(root: Path) -> dict[int, list[list[dict]]]:
    """``{K: [rows of each seed's run]}`` from ``root/K<k>/runs/*/`` (K 0: never reset), K ascending, never last."""
    out: dict[int, list[list[dict]]] = {}
    for folder in sorted(root.glob("K*")):
        m = re.fullmatch(r"K(\d+)", folder.name)
        runs = sorted(d for d in (folder / "runs").glob("*") if RunLayout(d).metrics.is_file()) if m else []
        if runs:
            out[int(m.group(1))] = [read_metrics(d) for d in runs]  # type: ignore[union-attr]
    return dict(sorted(out.items(), key=lambda kv: (kv[0] == 0, kv[0])))  # K ascending, never last


def by_age(runs: list[list[dict]], key: str) -> dict[int, dict]:
    """Per reference age: ``key``'s mean over each seed's rows of that age, then the interval over seeds."""
    per_age: dict[int, list[float]] = {}
    for rows in runs:
        seed: dict[int, list[float]] = {}
        for r in rows:
            if AGE in r and isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
                seed.setdefault(int(r[AGE]), []).append(float(r[key]))
        for age, vals in seed.items():
            per_age.setdefault(age, []).append(sum(vals) / len(vals))
    return {age: interval(v) for age, v in sorted(per_age.items())}


def run_means(runs: list[list[dict]], key: str, skip: int = 0) -> dict:
    """The interval over seeds of each run's mean ``key`` over its steps after ``skip``."""
    means = []
    for rows in runs:
        vals = [v for step, v in series(rows, key) if step > skip]
        if vals:
            means.append(sum(vals) / len(vals))
    return interval(means)


def k_table(sweep: dict[int, list[list[dict]]]) -> str:
    """Markdown: one row per K (the schedule as a whole), then the Brier by reference age for each K."""
    name = {k: "never" if k == 0 else str(k) for k in sweep}
    lines = [
        "| K | seeds | Brier during the update (run mean) | Brier after it | train reward (run mean) | last val |",
        "|---|---|---|---|---|---|",
    ]
    for k, runs in sweep.items():
        key = find_val_key(runs[0]) or ""
        last = interval([series(rows, key)[-1][1] for rows in runs if series(rows, key)]) if key else interval([])
        lines.append(
            f"| {name[k]} | {len(runs)} | {_pm(run_means(runs, BRIER))} | {_pm(run_means(runs, POST))} | "
            f"{_pm(run_means(runs, REWARD))} | {_pm(last)} |"
        )
    ages = sorted({a for runs in sweep.values() for a in by_age(runs, BRIER)})
    lines += ["", "Brier during the update by the reference's age (0: the reference is pi_old, as v1):", ""]
    lines += ["| age | " + " | ".join(f"K {name[k]}" for k in sweep) + " |", "|---|" + "---|" * len(sweep)]
    tables = {k: by_age(runs, BRIER) for k, runs in sweep.items()}
    for age in ages:
        cells = [_pm(tables[k][age]) if age in tables[k] else "" for k in sweep]
        lines.append(f"| {age} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(sweep: dict[int, list[list[dict]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key in zip(axes, (BRIER, POST)):
        for k, runs in sweep.items():
            t = by_age(runs, key)
            if not t:
                continue
            stats = list(t.values())
            label = f"K {'never' if k == 0 else k}"
            band(ax, list(t), [x["mean"] for x in stats], [x["half_width"] for x in stats], label, marker="o", ms=3)
        ax.axhline(0.25, color="grey", linewidth=0.8, linestyle="--")  # a coin's Brier (psi = 0)
        finish(ax, f"{key}, mean +- 95% CI over seeds", "reference age (updated steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", help="folder of K<k>/ compare --results folders")
    p.add_argument("--out", required=True, help="where k_table.md and brier_by_age.png go")
    args = p.parse_args(argv)
    sweep = load_sweep(Path(args.sweep))
    if not sweep:
        p.error(f"{args.sweep} has no K<k>/runs/ with a finished run: run examples/k_sweep_cpu.sh first")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "k_table.md").write_text(k_table(sweep))
    plot(sweep, out / "brier_by_age.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
