"""Paired differences between methods, and where each run ran (``pacs-megatron compare``'s summary).

Runs of one seed share their prompts, their first rollout batch and the seeds of their validation samples
(tools/compare/runs.py sets every seed of a run to it), so the difference of two methods on one seed cancels
the seed's own luck: its spread over seeds is smaller than either method's, and its 95% t-interval is the
honest answer to "does A beat B here". Pure functions of the runs' rows and records, checkable by hand.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from pacs_megatron.run.layout import RunLayout
from pacs_megatron.tools.compare.report import _pm, interval, run_score, series
from pacs_megatron.tools.compare.results import run_cpu

Runs = dict[int, list[dict]]
"""One method's finished runs by seed: each run's metrics rows."""


def parse_pairs(text: str, methods: list[str]) -> list[tuple[str, str]]:
    """``"pacs-grpo,pacs_v2-pacs"`` -> ``[("pacs", "grpo"), ("pacs_v2", "pacs")]``; empty: every method but the
    last minus the last (the baseline). ValueError naming ``--pairs`` for a method not compared.

    Example:
        >>> parse_pairs("", ["pacs", "pacs_v2", "grpo"])
        [('pacs', 'grpo'), ('pacs_v2', 'grpo')]
    """
    if not text.strip():
        return [(m, methods[-1]) for m in methods[:-1]]
    pairs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        a, sep, b = item.partition("-")
        if not sep or a not in methods or b not in methods or a == b:
            raise ValueError(
                f"--pairs {item!r}: give A-B with two methods of --methods {','.join(methods)}, e.g. "
                f"--pairs {methods[0]}-{methods[-1]}"
            )
        pairs.append((a, b))
    return pairs


def paired_differences(runs: dict[str, Runs], pairs: list[tuple[str, str]], key: str, last: int) -> list[dict]:
    """Per pair (a, b), over the seeds both finished: each seed's score of a minus b's (the mean of the ``last``
    validations of ``key``; the train reward of the last quarter beside it), their mean and 95% t-interval, and
    the same at each validation step."""
    out = []
    for a, b in pairs:
        seeds = sorted(set(runs.get(a, {})) & set(runs.get(b, {})))
        per_seed: list[dict] = []
        by_step: dict[int, list[float]] = {}
        for seed in seeds:
            (va, ta), (vb, tb) = run_score(runs[a][seed], key, last), run_score(runs[b][seed], key, last)
            per_seed.append({"seed": seed, "a": va, "b": vb, "diff": va - vb, "train_diff": ta - tb})
            sa, sb = dict(series(runs[a][seed], key)), dict(series(runs[b][seed], key))
            for step in sorted(sa.keys() & sb.keys()):
                by_step.setdefault(step, []).append(sa[step] - sb[step])
        out.append(
            {
                "pair": f"{a} - {b}",
                "a": a,
                "b": b,
                "seeds": seeds,
                "per_seed": per_seed,
                "diff": interval([r["diff"] for r in per_seed]),
                "train_diff": interval([r["train_diff"] for r in per_seed]),
                "by_step": {str(step): interval(d) for step, d in sorted(by_step.items())},
            }
        )
    return out


def run_facts(run_dir: Path, rows: list[dict]) -> dict:
    """Where and how a run ran: its CPU (launch.json), dtype (its config), the median step without validation
    and the median validation, in seconds."""
    layout = RunLayout(run_dir)
    cpu, dtype = run_cpu(run_dir) or "unknown", "unknown"
    if layout.config.is_file():
        from omegaconf import OmegaConf

        dtype = str(OmegaConf.load(layout.config).get("model", {}).get("dtype", "unknown"))
    steps = [r["timing/step_s"] - r.get("timing/eval_s", 0.0) for r in rows if "timing/step_s" in r]
    evals = [r["timing/eval_s"] for r in rows if "timing/eval_s" in r]
    return {
        "cpu": cpu,
        "dtype": dtype,
        "step_s": statistics.median(steps) if steps else float("nan"),
        "eval_s": statistics.median(evals) if evals else float("nan"),
    }


def paired_table(paired: list[dict], key: str, last: int) -> str:
    """Markdown: each pair's mean difference with its interval, per seed, and per validation step."""
    what = "the last validation" if last == 1 else f"the mean of the last {last} validations"
    lines = [
        f"Paired differences of {key} ({what}; a - b on the same seed), 95% t-interval over seeds:",
        "",
        "| a - b | seeds | difference | per seed | train reward difference |",
        "|---|---|---|---|---|",
    ]
    for p in paired:
        seeds = " ".join(f"{r['diff']:+.3f}" for r in p["per_seed"]) or "-"
        lines.append(
            f"| {p['pair']} | {len(p['seeds'])} | {_signed(p['diff'])} | {seeds} | {_signed(p['train_diff'])} |"
        )
    steps = sorted({int(s) for p in paired for s in p["by_step"]})
    if steps:
        lines += ["", "The same at each validation step:", ""]
        lines += ["| a - b | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
        for p in paired:
            cells = [_signed(p["by_step"][str(s)]) if str(s) in p["by_step"] else "-" for s in steps]
            lines.append(f"| {p['pair']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def facts_table(facts: dict[str, dict[int, dict]]) -> str:
    """Markdown: every run's CPU, dtype, median step and validation seconds."""
    lines = ["| method | seed | CPU | dtype | step s (median) | validation s |", "|---|---|---|---|---|---|"]
    for method, by_seed in facts.items():
        for seed, f in sorted(by_seed.items()):
            lines.append(f"| {method} | {seed} | {f['cpu']} | {f['dtype']} | {f['step_s']:.0f} | {f['eval_s']:.0f} |")
    return "\n".join(lines) + "\n"


def _signed(s: dict) -> str:
    """``+0.012 +- 0.020`` (the mean's sign always shown); the mean alone without an interval."""
    text = _pm(s)
    return text if text.startswith("-") or text == "nan" else "+" + text
