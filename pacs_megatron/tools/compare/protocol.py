"""``pacs-megatron compare``: methods over seeds, each at its own tuned lr, reported as paired differences.

    pacs-megatron compare --config examples/configs/cpu_generalize.yaml --out /tmp/cmp \\
        --methods pacs,grpo,ppo --seeds 5 --tune-seeds 2 --lrs 3e-4,1e-3,3e-3 --critic-lrs 3e-4,1e-3 \\
        --tune-key val/arith_val/pass@1 --val-key val/arith_heldout/pass@1 --background

Tune each method's lr (and critic lr, PACS v2's K) on tuning seeds and a validation split, run every method at
its choice on seeds 0..S-1 (one seed's runs share their prompts, first batch and validation samples), and write
``OUT/summary.{json,md}`` and ``OUT/curves.png``: per-method intervals over seeds and each pair's per-seed
differences. Every run is a ``pacs-megatron train`` process in ``OUT/runs/NAME-KEY`` (KEY hashes its resolved
settings), so the command resumes; ``--results DIR`` keeps finished runs' records for committing and reuses
them on any machine. The protocol, its fairness rules and its resource limits: docs/compare.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pacs_megatron.run.layout import RunLayout
from pacs_megatron.tools.compare.paired import facts_table, paired_differences, paired_table, parse_pairs, run_facts
from pacs_megatron.tools.compare.report import (
    final_definition,
    find_val_key,
    interval,  # noqa: F401  (re-exported: the public helpers of this tool)
    method_summary,
    plot,
    run_score,
    table,
)
from pacs_megatron.tools.compare.results import order_blocks
from pacs_megatron.tools.compare.runs import (
    METHODS,
    Runner,
    Spec,
    check_engine_share,
    uses_critic,
    uses_reference_anchor,
)
from pacs_megatron.utils.cpu import cpu_description
from pacs_megatron.utils.devices import share_gpus, visible_gpus
from pacs_megatron.utils.logging import get_logger, init_logging
from pacs_megatron.utils.preemption import unwind_on_signals

logger = get_logger(__name__)

TUNE_SEED0 = 1000


def grid_step(grid: list[float], side: int) -> float:
    """The next lr beyond a sorted grid on one side (-1 low, +1 high), on the 1-3-10 sequence.

    Example:
        >>> grid_step([3e-5, 1e-4, 3e-3], +1), grid_step([3e-5, 1e-4, 3e-3], -1)
        (0.01, 1e-05)
    """
    ladder = sorted(m * 10.0**e for e in range(-12, 3) for m in (1.0, 3.0))
    if side > 0:
        return next(x for x in ladder if x > grid[-1] * 1.5)
    return next(x for x in reversed(ladder) if x < grid[0] / 1.5)


def tune(
    runner: Runner,
    grids: dict[str, list[float]],
    spec: Callable[[str, float, int], Spec],
    score_key: str,
    max_extend: int,
) -> dict[str, dict]:
    """Pick each method's best value on its grid, growing an edge optimum outward (all methods' runs
    go to the runner together). Returns per method: scores per value, the chosen value, interior."""
    grids = {m: sorted(g) for m, g in grids.items()}
    grown = {m: {-1: 0, 1: 0} for m in grids}
    out: dict[str, dict] = {}
    while True:
        specs = [spec(m, v, TUNE_SEED0 + k) for m, g in grids.items() for v in g for k in range(runner.args.tune_seeds)]
        res = runner.run_all(specs)
        todo = {}
        for m, grid in grids.items():
            scores = {}
            for v in grid:
                runs = [res[spec(m, v, TUNE_SEED0 + k)] for k in range(runner.args.tune_seeds)]
                s = [run_score(r, score_key) for r in runs if r]
                s = [x for x in s if not math.isnan(x[0])]
                scores[f"{v:g}"] = [sum(x[0] for x in s) / len(s), sum(x[1] for x in s) / len(s)] if s else [-1.0, -1.0]
            best = max(grid, key=lambda v: tuple(scores[f"{v:g}"]))
            side = -1 if best == grid[0] else 1 if best == grid[-1] else 0
            interior = side == 0 and len(grid) > 2
            out[m] = {"scores": scores, "chosen": best, "interior": interior, "grid": grid}
            if side and len(grid) > 1 and grown[m][side] < max_extend:
                grown[m][side] += 1
                todo[m] = sorted([*grid, grid_step(grid, side)])
                logger.info("%s: best value %g is the grid's edge: adding %g", m, best, grid_step(grid, side))
        if not todo:
            return out
        grids = todo  # only the grown methods need new runs; the others keep their results in `out`


def check_validates(args: argparse.Namespace) -> str | None:
    """Why the runs would never validate (the comparison's score), or None: checked before any run starts, on
    each method's settings (the overrides may need them: a reset period K needs PACS v2's anchor)."""
    from pacs_megatron.config import ConfigError, load_config
    from pacs_megatron.launch.checks.device import check_device

    steps = [f"trainer.total_steps={args.steps}"] if args.steps else []
    try:
        for method in args.methods:
            cfg = load_config(args.config, [*METHODS[method], *args.overrides, *steps])
            check_device(cfg)  # a quantization the device cannot run fails every run: say so before any starts
    except ConfigError as e:
        return f"{method}: {e}"
    t = cfg.trainer
    if not 0 < t.test_freq <= t.total_steps:
        return (
            f"compare scores held-out validations, but trainer.test_freq={t.test_freq} with trainer.total_steps="
            f"{t.total_steps} never validates: add trainer.test_freq=N (1 <= N <= {t.total_steps}) to the overrides"
        )
    return None


def compare(args: argparse.Namespace) -> dict:
    from pacs_megatron.config import load_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(args)
    critic_lrs = args.critic_lrs or [None]
    mid_critic = sorted(critic_lrs, key=lambda x: x or 0.0)[len(critic_lrs) // 2]
    # Each method's current choice as a run spec (its seed is replaced per run).
    grids = {m: args.method_lrs.get(m, args.lrs) for m in args.methods}
    chosen = {m: Spec(m, grids[m][0], 0, mid_critic if uses_critic(m) else None) for m in args.methods}
    tuning: dict = {m: {} for m in args.methods}
    val_key = args.val_key
    tune_key = args.tune_key or val_key
    anchors = [m for m in args.methods if uses_reference_anchor(m)]
    anchored = anchors if len(args.reset_every) > 1 else []  # K tuned
    # each anchored method's K when a spec leaves it to the config (its method's overrides, the user's)
    config_k = {
        m: load_config(args.config, runner.settings(*chosen[m])).algorithm.reference_reset_every for m in anchors
    }
    if len(args.reset_every) == 1:  # K given, not tuned; the config's own K stays None (the same run's key)
        k = args.reset_every[0]
        chosen |= {m: chosen[m]._replace(reset_every=None if k == config_k[m] else k) for m in anchors}
    if any(len(g) > 1 for g in grids.values()) or len(critic_lrs) > 1 or anchored:
        if not tune_key:  # the first validation key any run logs
            probe = runner.run_all([chosen[args.methods[0]]._replace(seed=TUNE_SEED0)])
            tune_key = next((find_val_key(r) for r in probe.values() if r), None) or "val/none/pass@1"
        if tune_key == (val_key or tune_key):
            logger.warning(
                "tuning and reporting on the same metric (%s): pass --tune-key (a validation split)", tune_key
            )

        def actor_spec(m, lr, seed):
            return chosen[m]._replace(lr=lr, seed=seed)

        def critic_spec(m, clr, seed):
            return chosen[m]._replace(critic_lr=clr, seed=seed)

        def k_spec(m, k, seed):
            # the config's own K stays None, so the lr pass's run at that K is this pass's too (same name)
            k = int(round(k))
            return chosen[m]._replace(reset_every=None if k == config_k[m] else k, seed=seed)

        if any(len(g) > 1 for g in grids.values()):
            tuned = {m: g for m, g in grids.items() if len(g) > 1}
            for m, t in tune(runner, tuned, actor_spec, tune_key, args.max_extend).items():
                tuning[m]["lr"], chosen[m] = t, chosen[m]._replace(lr=t["chosen"])
        critics = [m for m in args.methods if uses_critic(m)]
        if len(critic_lrs) > 1 and critics:
            for m, t in tune(runner, {m: critic_lrs for m in critics}, critic_spec, tune_key, args.max_extend).items():
                tuning[m]["critic_lr"], chosen[m] = t, chosen[m]._replace(critic_lr=t["chosen"])
        if anchored:  # PACS v2's reset period K, at the chosen lr: issue 39's "choose K by measurement"
            for m, t in tune(
                runner, {m: args.reset_every for m in anchored}, k_spec, tune_key, args.max_extend
            ).items():
                tuning[m]["reset_every"], chosen[m] = t, k_spec(m, t["chosen"], 0)
        logger.info("chosen (lr, critic lr, K): %s", {m: (c.lr, c.critic_lr, c.reset_every) for m, c in chosen.items()})
    # Seed-major order, one seed's block of methods at a time and on one CPU (a block that began on another
    # CPU waits for one of its kind): a comparison cut short still has whole pairs on its first seeds.
    here = cpu_description()
    block = {seed: [chosen[m]._replace(seed=seed) for m in args.methods] for seed in range(args.seeds)}
    for sp in (sp for b in block.values() for sp in b):
        runner.restore(sp)
    order, deferred = order_blocks({seed: [runner.run_dir(*sp) for sp in b] for seed, b in block.items()}, here)
    for seed, cpu in deferred.items():
        logger.warning(
            "seed %d: its runs began on %s, this is %s: its block waits for a CPU of its kind", seed, cpu, here
        )
        runner.pending |= {sp for sp in block[seed] if not RunLayout(runner.run_dir(*sp)).final.is_file()}
    res = runner.run_all([sp for seed in [*order, *deferred] for sp in block[seed]])
    val_key = val_key or next((find_val_key(r) for r in res.values() if r and find_val_key(r)), None)
    if val_key is None:
        raise RuntimeError("no run logged a val/*/pass@1 metric: set trainer.test_freq (and --val-key)")
    tune_key = tune_key or val_key
    methods, finished, facts = {}, {}, {}
    for m in args.methods:
        specs_m = {seed: chosen[m]._replace(seed=seed) for seed in range(args.seeds)}
        results = {seed: res[sp] for seed, sp in specs_m.items() if sp not in runner.pending}
        finished[m] = {seed: rows for seed, rows in results.items() if rows}
        facts[m] = {seed: run_facts(runner.run_dir(*specs_m[seed]), rows) for seed, rows in finished[m].items()}
        methods[m] = {
            "lr": chosen[m].lr,
            "critic_lr": chosen[m].critic_lr,
            **({"reset_every": chosen[m].reset_every or config_k[m]} if m in anchors else {}),
            **method_summary(results, val_key, tune_key, args.score_validations),
            "pending_seeds": sorted(seed for seed, sp in specs_m.items() if sp in runner.pending),
            "runs": {str(seed): f for seed, f in facts[m].items()},
        }
    paired = paired_differences(finished, args.pairs, val_key, args.score_validations)
    summary = {
        "config": args.config,
        "overrides": args.overrides,
        "steps": args.steps,
        "seeds": args.seeds,
        "tune_seeds": args.tune_seeds if any(tuning.values()) else 0,
        "lrs": args.lrs,
        "method_lrs": args.method_lrs,
        "critic_lrs": args.critic_lrs,
        "reset_every": args.reset_every,
        "val_key": val_key,
        "tune_key": tune_key,
        "score_validations": args.score_validations,
        "final_definition": final_definition(args.score_validations),
        "tuning": {m: t for m, t in tuning.items() if t},
        "methods": methods,
        "paired": paired,
    }
    md = table(summary)
    if paired:
        md += "\n" + paired_table(paired, val_key, args.score_validations)
    md += "\nWhere each run ran:\n\n" + facts_table(facts)
    pending = {m: s["pending_seeds"] for m, s in methods.items() if s["pending_seeds"]}
    if pending:
        md += f"\nNot finished yet (--report-only): {pending}\n"
    for folder in dict.fromkeys([out, *([Path(args.results)] if args.results else [])]):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "summary.json").write_text(json.dumps(summary, indent=1))
        (folder / "summary.md").write_text(md)
        plot(summary, folder / "curves.png")
    logger.info("wrote %s, %s and %s\n%s", out / "summary.json", out / "summary.md", out / "curves.png", md)
    return summary


def _floats(flag: str, text: str) -> list[float]:
    """``"3e-4,1e-3"`` -> ``[0.0003, 0.001]``; ConfigError naming ``flag`` for anything else (all > 0)."""
    from pacs_megatron.config import ConfigError

    try:
        values = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give comma-separated numbers, e.g. {flag} 3e-4,1e-3,3e-3") from None
    if any(not v > 0 for v in values):
        raise ConfigError(f"{flag} {text!r}: every value must be > 0")
    return values


def _method_grids(items: list[str], methods: list[str]) -> dict[str, list[float]]:
    """``["pacs_lora=3e-5,1e-4"]`` -> ``{"pacs_lora": [3e-05, 0.0001]}``; ConfigError naming the flag, for a
    method not in --methods (its grid would silently do nothing) or a malformed entry."""
    from pacs_megatron.config import ConfigError

    grids: dict[str, list[float]] = {}
    for item in items:
        method, sep, grid = item.partition("=")
        if not sep or method.strip() not in methods:
            raise ConfigError(
                f"--method-lrs {item!r}: give METHOD=GRID for a method of --methods {','.join(methods)}, "
                "e.g. --method-lrs pacs_lora=3e-5,1e-4,3e-4"
            )
        grids[method.strip()] = _floats(f"--method-lrs {method.strip()}=", grid)
        if not grids[method.strip()]:
            raise ConfigError(f"--method-lrs {item!r} is empty: give at least one lr")
    return grids


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the run config every run starts from")
    p.add_argument("--out", required=True, help="output folder (runs/, summary.json, curves.png)")
    p.add_argument("--methods", default="pacs,grpo,ppo", help=f"comma-separated, from {sorted(METHODS)}")
    p.add_argument("--seeds", type=int, default=5, help="reported seeds 0..S-1")
    p.add_argument("--tune-seeds", type=int, default=2, help="seeds 1000.. used only to pick each method's lr")
    p.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="comma-separated lr grid (one value: no tuning)")
    p.add_argument(
        "--method-lrs",
        action="append",
        default=[],
        metavar="METHOD=GRID",
        help="a method's own lr grid instead of --lrs, e.g. pacs_lora=3e-5,1e-4,3e-4 (LoRA's lrs are ~10x full's)",
    )
    p.add_argument(
        "--reset-every",
        default="",
        help="PACS v2 reset periods K to tune (e.g. 5,10,20) for methods anchored on a reference, at their chosen lr",
    )
    p.add_argument("--critic-lrs", default="", help="critic lr grid for critic methods (ppo); empty: the config's")
    p.add_argument(
        "--max-extend", type=int, default=2, help="values a grid may grow per side while its best is an edge"
    )
    p.add_argument("--steps", type=int, default=0, help="trainer.total_steps of every run (0: the config's)")
    p.add_argument("--jobs", type=int, default=0, help="runs at a time (0: CPU cores // ranks per run)")
    p.add_argument("--val-key", default="", help="reported (held-out) metric (default: the first val/*/pass@1)")
    p.add_argument(
        "--tune-key", default="", help="metric the lrs are tuned on, e.g. a validation split (default: --val-key)"
    )
    p.add_argument("--score-validations", type=int, default=3, help="a run's score: the mean of its last N validations")
    p.add_argument("--pairs", default="", help="paired differences A-B,... (default: each method minus the last)")
    p.add_argument(
        "--results",
        default="",
        help="keep each finished run's record (no checkpoints) in DIR/runs/ and reuse the runs found there: "
        "commit DIR and a later session, on any machine, resumes the protocol; the summary goes there too",
    )
    p.add_argument("--report-only", action="store_true", help="summarise the runs finished so far; start none")
    p.add_argument("--background", action="store_true", help="detach; log to OUT/compare.log")
    p.add_argument("overrides", nargs="*", help="a.b=c overrides applied to every run")


def check_args(args: argparse.Namespace) -> None:
    """Parse and check every flag before any run starts; ConfigError naming the flag and the fix."""
    from pacs_megatron.config import ConfigError
    from pacs_megatron.utils.paths import check_writable_dir

    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        raise ConfigError(f"--methods has {bad or 'nothing'}: choose from {sorted(METHODS)}")
    args.lrs, args.critic_lrs = _floats("--lrs", args.lrs), _floats("--critic-lrs", args.critic_lrs)
    if not args.lrs:
        raise ConfigError("--lrs is empty: give at least one lr, e.g. --lrs 1e-3")
    args.method_lrs = _method_grids(args.method_lrs, args.methods)
    args.reset_every = _floats("--reset-every", args.reset_every)
    if any(k != int(k) for k in args.reset_every):
        raise ConfigError(f"--reset-every {args.reset_every}: K is a number of steps, give whole numbers, e.g. 5,10,20")
    args.reset_every = [int(k) for k in args.reset_every]
    if args.reset_every and not any(uses_reference_anchor(m) for m in args.methods):
        raise ConfigError(
            f"--reset-every {args.reset_every} tunes PACS v2's reset period, but no method of --methods "
            f"{','.join(args.methods)} anchors on the reference: add pacs_v2 or drop the flag"
        )
    for flag, value, least in (
        ("--seeds", args.seeds, 1),
        ("--tune-seeds", args.tune_seeds, 1),
        ("--steps", args.steps, 0),
        ("--jobs", args.jobs, 0),
        ("--max-extend", args.max_extend, 0),
        ("--score-validations", args.score_validations, 1),
    ):
        if value < least:
            raise ConfigError(f"{flag} {value} must be >= {least}")
    try:
        args.pairs = parse_pairs(args.pairs, args.methods) if len(args.methods) > 1 else []
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_writable_dir("--out", args.out)
    if args.results:
        check_writable_dir("--results", args.results)
    problem = check_validates(args)
    if problem:
        raise ConfigError(problem)


def main(args: argparse.Namespace) -> int:
    init_logging()
    check_args(args)
    if args.background:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        argv = [a for a in sys.argv[1:] if a != "--background"]
        with (out / "compare.log").open("a") as log:
            cmd = [sys.executable, "-m", "pacs_megatron", *argv]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        logger.info("comparison running in the background (pid %d): tail -f %s", proc.pid, out / "compare.log")
        return 0
    from pacs_megatron.config import load_config

    cfg = load_config(args.config, [*METHODS[args.methods[0]], *args.overrides])
    ranks = cfg.parallel.world_size
    args.jobs = args.jobs or max(1, (os.cpu_count() or 1) // ranks)
    args.threads_per_rank = max(1, (os.cpu_count() or 1) // (args.jobs * ranks))
    args.ranks_per_run = ranks
    args.gpus = visible_gpus()  # once: the engine check here and the Runner's pinning read the same list
    check_engine_share(cfg, share_gpus(args.jobs, ranks, args.gpus)[1], args.jobs)
    # SIGTERM (kill PID) unwinds like Ctrl-C, so Runner stops its runs: none is left going. A second one
    # kills them all at once, even while this process waits in a native call (utils/preemption.py).
    unwind_on_signals("the runs' current steps were not saved (rerun the command to resume them)")
    compare(args)
    return 0
