"""What ``pacs-megatron compare`` writes: scores, intervals over seeds, the tables and the plot.

Pure functions of the runs' ``metrics.jsonl`` rows, so the numbers in ``summary.json`` can be checked
by hand (tests/tools/compare/test_protocol.py does).
"""

from __future__ import annotations

import math
from pathlib import Path

TRAIN_KEY = "reward/mean"
EXTRA_CURVES = ("actor/entropy", "pacs/psi_abs_mean", "pacs/brier", "pacs/post_psi_abs_mean", "pacs/post_brier")
"""Curves kept and drawn beside the scores where the runs log them: the policy's entropy (collapse or not) and
the PACS classifier at work (psi's size, the Brier score of sigmoid(psi) against the outcome; during the update
and, ``post_``, after it)."""
# Two-sided 95% Student-t quantiles for 1..10 degrees of freedom (normal beyond).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
FINAL_DEFINITION = "validation metrics: mean of the last 3 validations; train reward: mean of the last quarter"


def final_definition(last: int = 3) -> str:
    """What a run's reported score is, for ``last`` validations averaged."""
    return FINAL_DEFINITION.replace(
        "last 3 validations", "last validation" if last == 1 else f"last {last} validations"
    )


def interval(xs: list[float]) -> dict:
    """Mean and 95% t-interval half-width over seeds (half-width nan for one value).

    Example:
        >>> interval([1.0, 2.0, 3.0])["half_width"]  # t(2) * 1 / sqrt(3)
        2.4843...
    """
    n = len(xs)
    mean = sum(xs) / n if n else float("nan")
    if n < 2:
        return {"mean": mean, "half_width": float("nan"), "n": n}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    return {"mean": mean, "half_width": t * sd / math.sqrt(n), "n": n}


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]


def find_val_key(rows: list[dict]) -> str | None:
    keys = sorted({k for r in rows for k in r if k.startswith("val/") and k.endswith("/pass@1")})
    return keys[0] if keys else None


def run_score(rows: list[dict], val_key: str, last: int = 3) -> tuple[float, float]:
    """(mean of the last ``last`` values of ``val_key``, mean train reward of the last quarter)."""
    val = [v for _, v in series(rows, val_key)][-last:]
    train = [v for _, v in series(rows, TRAIN_KEY)]
    tail = train[-max(1, len(train) // 4) :]
    return (sum(val) / len(val) if val else float("nan"), sum(tail) / len(tail) if tail else float("nan"))


def curves(results: dict[int, list[dict]], key: str) -> dict:
    """Per step: mean and 95% half-width over the seeds that logged ``key`` at that step."""
    per_step: dict[int, list[float]] = {}
    for rows in results.values():
        for step, v in series(rows, key):
            per_step.setdefault(step, []).append(v)
    steps = sorted(per_step)
    stats = [interval(per_step[s]) for s in steps]
    return {"step": steps, "mean": [s["mean"] for s in stats], "half_width": [s["half_width"] for s in stats]}


def pass_at_k_keys(rows: list[dict], val_key: str) -> list[str]:
    """The held-out split's other pass@k keys beside ``val_key`` (``.../pass@1``), k ascending."""
    stem = val_key.rsplit("/", 1)[0] + "/pass@"
    ks = sorted({int(k[len(stem) :]) for r in rows for k in r if k.startswith(stem) and k[len(stem) :].isdigit()})
    return [f"{stem}{k}" for k in ks if f"{stem}{k}" != val_key]


def method_summary(results: dict[int, list[dict] | None], val_key: str, tune_key: str, last: int = 3) -> dict:
    """One method's reported seeds: per-seed scores (the mean of the ``last`` validations), their intervals
    (pass@1 and the held-out split's other pass@k), and the mean curves (with :data:`EXTRA_CURVES` where logged)."""
    ok = {seed: rows for seed, rows in results.items() if rows}
    every = [r for rows in ok.values() for r in rows]
    extra = [k for k in EXTRA_CURVES if any(k in r for r in every)]
    per_seed = []
    for seed, rows in sorted(ok.items()):
        heldout, train = run_score(rows, val_key, last)
        tune = run_score(rows, tune_key, last)[0]
        per_seed.append({"seed": seed, "heldout": heldout, "tune": tune, "train_reward": train})
    return {
        "seeds": sorted(ok),
        "failed_seeds": sorted(s for s, r in results.items() if not r),
        "per_seed": per_seed,
        "final_heldout": interval([s["heldout"] for s in per_seed]),
        "final_tune": interval([s["tune"] for s in per_seed]),
        "final_train_reward": interval([s["train_reward"] for s in per_seed]),
        "final_pass_at_k": {
            k: interval([run_score(rows, k, last)[0] for rows in ok.values()]) for k in pass_at_k_keys(every, val_key)
        },
        "curves": {key: curves(ok, key) for key in dict.fromkeys([TRAIN_KEY, val_key, tune_key, *extra])},
    }


def _pm(s: dict) -> str:
    """``mean +- half-width``; with one seed there is no interval, so the mean alone (not ``+- nan``)."""
    if not math.isfinite(s["half_width"]):
        return f"{s['mean']:.3f}"
    return f"{s['mean']:.3f} +- {s['half_width']:.3f}"


def _lrs(s: dict) -> str:
    critic = f" (critic {s['critic_lr']:g})" if s.get("critic_lr") is not None else ""
    return f"{s['lr']:g}{critic}" + (f", K {s['reset_every']}" if s.get("reset_every") is not None else "")


def table(summary: dict) -> str:
    """Markdown: the final values (mean +- 95% t-interval over seeds; the mean alone for one seed), per seed,
    and the tuning grid. When the tuning metric is the held-out one (one validation set), it is one column."""
    val, tune = summary["val_key"], summary["tune_key"]
    both = tune != val
    head = f"| {val} | {tune} |" if both else f"| {val} |"
    rule = "|---|---|" if both else "|---|"
    lines = [f"| method | lr | seeds {head} train {TRAIN_KEY} |", f"|---|---|---{rule}---|"]
    for m, s in summary["methods"].items():
        tuned = f"{_pm(s['final_tune'])} | " if both else ""
        lines.append(
            f"| {m} | {_lrs(s)} | {s['final_heldout']['n']} | {_pm(s['final_heldout'])} | "
            f"{tuned}{_pm(s['final_train_reward'])} |"
        )
    lines += ["", "Per seed:", "", f"| method | seed {head} train {TRAIN_KEY} |", f"|---|---{rule}---|"]
    for m, s in summary["methods"].items():
        for r in s["per_seed"]:
            tuned = f"{r['tune']:.3f} | " if both else ""
            lines.append(f"| {m} | {r['seed']} | {r['heldout']:.3f} | {tuned}{r['train_reward']:.3f} |")
        for seed in s["failed_seeds"]:
            lines.append(f"| {m} | {seed} | failed | " + ("failed | " if both else "") + "failed |")
    ks = sorted({k for s in summary["methods"].values() for k in s.get("final_pass_at_k", {})}, key=_k_of)
    if ks:
        last = summary.get("score_validations", 3)
        what = "the last validation" if last == 1 else f"mean of the last {last} validations"
        lines += ["", f"Held-out pass@k ({what}, 95% interval over seeds):", ""]
        lines += ["| method | " + " | ".join(ks) + " |", "|---|" + "---|" * len(ks)]
        for m, s in summary["methods"].items():
            cells = [_pm(s["final_pass_at_k"][k]) if k in s.get("final_pass_at_k", {}) else "-" for k in ks]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if summary["tuning"]:
        lines += ["", f"Tuning ({tune}, then train reward; mean over the tuning seeds):", ""]
        lines += ["| method | parameter | value | score | train reward | chosen |", "|---|---|---|---|---|---|"]
        for m, t in summary["tuning"].items():
            for param in ("lr", "critic_lr", "reset_every"):
                if param not in t:
                    continue
                grid = t[param]
                for value, (score, train) in sorted(grid["scores"].items(), key=lambda kv: float(kv[0])):
                    mark = "yes" if float(value) == grid["chosen"] else ""
                    if mark and not grid["interior"]:
                        mark += " (edge of the grid)"
                    lines.append(f"| {m} | {param} | {value} | {score:.3f} | {train:.3f} | {mark} |")
    return "\n".join(lines) + "\n"


def _k_of(key: str) -> int:
    return int(key.rsplit("@", 1)[1])


def plot(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logged = {k for s in summary["methods"].values() for k, c in s["curves"].items() if c["step"]}
    keys = list(dict.fromkeys([TRAIN_KEY, summary["val_key"], *(k for k in EXTRA_CURVES if k in logged)]))
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for method, s in summary["methods"].items():
            c = s["curves"].get(key)
            if not c or not c["step"]:
                continue
            band(ax, c["step"], c["mean"], c["half_width"], f"{method} (lr {_lrs(s)})", linewidth=1.4)
        finish(ax, f"{key}: mean +- 95% CI over {_finished(summary)} seeds", "step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finished(summary: dict) -> str:
    """"2 of 6": the seeds each method finished (a range where they differ) of the planned ones."""
    done = sorted({len(s["seeds"]) for s in summary["methods"].values()}) or [0]
    n = str(done[0]) if len(done) == 1 else f"{done[0]}-{done[-1]}"
    return n if n == str(summary["seeds"]) else f"{n} of {summary['seeds']}"


def band(ax, xs: list, means: list[float], halves: list[float], label: str, **line) -> None:
    """A mean curve and its 95% band (no band where the half-width is nan: one seed)."""
    h = [x if math.isfinite(x) else 0.0 for x in halves]
    (drawn,) = ax.plot(xs, means, label=label, **line)
    ax.fill_between(xs, [m - d for m, d in zip(means, h)], [m + d for m, d in zip(means, h)],
                    color=drawn.get_color(), alpha=0.2)  # fmt: skip


def finish(ax, title: str, xlabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
