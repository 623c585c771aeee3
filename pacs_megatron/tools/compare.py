"""``pacs-megatron compare``: PACS vs the baselines over seeds, each with its own tuned lr.

    pacs-megatron compare --config examples/configs/cpu_generalize.yaml --out /tmp/cmp \\
        --methods pacs,grpo,ppo --seeds 5 --tune-seeds 2 --lrs 3e-4,1e-3,3e-3 --background

Protocol (fair by construction):

1. **Tune** (skipped with one lr): every method x lr runs on the *tuning* seeds (1000, 1001, ...),
   which are never reported. A run's score is the mean of its held-out metric (``--val-key``,
   default the first ``val/*/pass@1``) over its last three validations, ties broken by the mean
   train reward of its last quarter. Each method keeps its best lr.
2. **Report**: every method at its lr on seeds 0..S-1 (``trainer.seed``, ``model.seed``, ``data.seed``
   and ``rollout.seed`` all set to the seed; the held-out split, ``data.arith.split_seed``, is not).
3. **Summarise**: ``OUT/summary.json`` (settings, tuning scores, chosen lrs, per-method final values
   with 95% t-intervals over seeds, the per-step curves), ``OUT/summary.md`` (the table) and
   ``OUT/curves.png`` (mean +- 95% interval of train reward and held-out pass@1 per method).

Each run is ``pacs-megatron train`` in its own process and output dir ``OUT/runs/NAME-KEY``, where KEY
hashes the run's resolved config (config file, overrides, ``--steps``, seed, lr): a run with
``final.json`` is done *for those settings*; any other is (re)started and resumes from its own
checkpoint, so the whole command is resumable: rerun it with the same arguments; changed settings
(``--steps 6`` after ``--steps 4``) get new runs, never the old ones' results. At most ``--jobs`` runs
at a time (default: CPU cores // ranks per run). ``OUT/progress.json`` and the log show progress;
``--background`` detaches the command (log in ``OUT/compare.log``).

Before any run starts, the config must validate (``trainer.test_freq`` > 0 and <= the steps): the
comparison is scored on held-out validations. Runs die with the command: SIGTERM / Ctrl-C stop them
(each checkpoints, so a rerun resumes), and SIGKILL kills them (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pacs_megatron.utils.logging import get_logger, init_logging
from pacs_megatron.utils.plot import read_metrics
from pacs_megatron.utils.proc import die_with_parent

logger = get_logger(__name__)

METHODS: dict[str, list[str]] = {
    "pacs": ["algorithm.loss=pacs"],
    "grpo": ["algorithm.loss=grpo", "algorithm.policy.adv_estimator=grpo"],
    # The paper's PPO baseline: GAE advantages from a learned critic.
    "ppo": ["algorithm.loss=ppo", "algorithm.policy.adv_estimator=gae"],
    # PPO-clip with the critic-free leave-one-out baseline (this project's earlier "ppo").
    "ppo_rloo": ["algorithm.loss=ppo", "algorithm.policy.adv_estimator=rloo"],
}
TUNE_SEED0 = 1000
TRAIN = (sys.executable, "-m", "pacs_megatron", "train")
TRAIN_KEY = "reward/mean"
# Two-sided 95% Student-t quantiles for 1..10 degrees of freedom (normal beyond).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


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


def run_name(method: str, lr: float, seed: int) -> str:
    return f"{method}_lr{lr:g}_s{seed}"


def _series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]


def find_val_key(rows: list[dict]) -> str | None:
    keys = sorted({k for r in rows for k in r if k.startswith("val/") and k.endswith("/pass@1")})
    return keys[0] if keys else None


def run_score(rows: list[dict], val_key: str) -> tuple[float, float]:
    """(mean of the last three held-out values, mean train reward of the last quarter)."""
    val = [v for _, v in _series(rows, val_key)][-3:]
    train = [v for _, v in _series(rows, TRAIN_KEY)]
    tail = train[-max(1, len(train) // 4) :]
    return (sum(val) / len(val) if val else float("nan"), sum(tail) / len(tail) if tail else float("nan"))


class Runner:
    """Launches ``pacs-megatron train`` runs, at most ``jobs`` at a time; resumable by final.json."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out)
        self.done = 0
        self.total = 0
        self._dirs: dict[tuple, Path] = {}

    def settings(self, method: str, lr: float, seed: int) -> list[str]:
        """The overrides that make this run (all but its directories)."""
        return [
            *METHODS[method],
            f"optimizer.lr={lr}",
            f"trainer.seed={seed}",
            f"model.seed={seed}",
            f"data.seed={seed}",
            f"rollout.seed={seed}",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            *([f"trainer.total_steps={self.args.steps}"] if self.args.steps else []),
            *self.args.overrides,
        ]

    def run_dir(self, method: str, lr: float, seed: int) -> Path:
        """``OUT/runs/NAME-KEY``: KEY hashes the resolved config, so other settings never reuse this run."""
        from pacs_megatron.config import load_config, to_yaml

        spec = (method, lr, seed)
        if spec not in self._dirs:
            resolved = to_yaml(load_config(self.args.config, self.settings(*spec)))
            key = hashlib.sha256(resolved.encode()).hexdigest()[:10]
            self._dirs[spec] = self.out / "runs" / f"{run_name(*spec)}-{key}"
        return self._dirs[spec]

    def command(self, method: str, lr: float, seed: int) -> list[str]:
        d = self.run_dir(method, lr, seed)
        settings = self.settings(method, lr, seed)
        return [*TRAIN, f"--config={self.args.config}", *settings, f"trainer.output_dir={d}", f"model.path={d}/model"]

    def run_all(self, specs: list[tuple[str, float, int]]) -> dict[tuple[str, float, int], list[dict] | None]:
        """Run every spec not yet done; return each spec's metrics rows (None when it failed)."""
        todo = [s for s in specs if not (self.run_dir(*s) / "final.json").is_file()]
        self.total += len(specs)
        self.done += len(specs) - len(todo)
        running: dict[tuple, tuple[subprocess.Popen, object]] = {}
        failed: set = set()
        try:
            self._run(todo, running, failed)
        finally:  # stopped (SIGTERM, Ctrl-C) or failed: the runs stop with the command
            _stop_runs(running)
        out = {}
        for spec in specs:
            d = self.run_dir(*spec)
            out[spec] = None if spec in failed or not (d / "metrics.jsonl").is_file() else read_metrics(d)
        return out

    def _run(self, todo: list, running: dict, failed: set) -> None:
        while todo or running:
            while todo and len(running) < self.args.jobs:
                spec = todo.pop(0)
                d = self.run_dir(*spec)
                d.mkdir(parents=True, exist_ok=True)
                log = (d / "train.log").open("a")
                proc = subprocess.Popen(
                    self.command(*spec), stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
                )
                running[spec] = (proc, log)
                logger.info("started %s", run_name(*spec))
            time.sleep(1.0)
            for spec, (proc, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[spec]
                self.done += 1
                if proc.returncode != 0:
                    failed.add(spec)
                    logger.error("%s failed (exit %d): see its train.log", run_name(*spec), proc.returncode)
                logger.info("progress: %d/%d runs done", self.done, self.total)
                self._progress(list(running))

    def _progress(self, running: list[tuple]) -> None:
        state = {"done": self.done, "total": self.total, "running": [run_name(*s) for s in running]}
        (self.out / "progress.json").write_text(json.dumps(state, indent=1))


def _stop_runs(running: dict, grace_s: float = 120.0) -> None:
    """SIGTERM every run still going (each checkpoints and exits 143), SIGKILL what outlives grace_s."""
    if not running:
        return
    logger.warning("stopping %d runs (each checkpoints; rerun the command to resume)", len(running))
    for proc, _ in running.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for proc, log in running.values():
        try:
            proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    running.clear()


def check_validates(args: argparse.Namespace) -> str | None:
    """Why the runs would never validate (the comparison's score), or None: checked before any run starts."""
    from pacs_megatron.config import ConfigError, load_config

    steps = [f"trainer.total_steps={args.steps}"] if args.steps else []
    try:
        cfg = load_config(args.config, [*args.overrides, *steps])
    except ConfigError as e:
        return str(e)
    t = cfg.trainer
    if not 0 < t.test_freq <= t.total_steps:
        return (
            f"compare scores held-out validations, but trainer.test_freq={t.test_freq} with trainer.total_steps="
            f"{t.total_steps} never validates: add trainer.test_freq=N (1 <= N <= {t.total_steps}) to the overrides"
        )
    return None


def _curves(results: dict[int, list[dict]], key: str) -> dict:
    """Per step: mean and 95% half-width over the seeds that logged ``key`` at that step."""
    per_step: dict[int, list[float]] = {}
    for rows in results.values():
        for step, v in _series(rows, key):
            per_step.setdefault(step, []).append(v)
    steps = sorted(per_step)
    stats = [interval(per_step[s]) for s in steps]
    return {"step": steps, "mean": [s["mean"] for s in stats], "half_width": [s["half_width"] for s in stats]}


def summarise(args, tuning: dict, chosen: dict, reported: dict, val_key: str) -> dict:
    """The summary dict: settings, tuning, final values with intervals, curves."""
    methods = {}
    for method, results in reported.items():
        ok = {seed: rows for seed, rows in results.items() if rows}
        scores = [run_score(rows, val_key) for rows in ok.values()]
        methods[method] = {
            "lr": chosen[method],
            "seeds": sorted(ok),
            "failed_seeds": sorted(s for s, r in results.items() if not r),
            "final_heldout": interval([s[0] for s in scores]),
            "final_train_reward": interval([s[1] for s in scores]),
            "curves": {TRAIN_KEY: _curves(ok, TRAIN_KEY), val_key: _curves(ok, val_key)},
        }
    return {
        "config": args.config,
        "overrides": args.overrides,
        "steps": args.steps,
        "seeds": args.seeds,
        "tune_seeds": args.tune_seeds if len(args.lrs) > 1 else 0,
        "lrs": args.lrs,
        "val_key": val_key,
        "final_definition": "held-out: mean of the last 3 validations; train reward: mean of the last quarter",
        "tuning": tuning,
        "methods": methods,
    }


def table(summary: dict) -> str:
    """Markdown table of the final values (mean +- 95% t-interval over the reported seeds)."""
    lines = [
        f"| method | lr | seeds | {summary['val_key']} | train {TRAIN_KEY} |",
        "|---|---|---|---|---|",
    ]
    for m, s in summary["methods"].items():
        h, t = s["final_heldout"], s["final_train_reward"]
        lines.append(
            f"| {m} | {s['lr']:g} | {h['n']} | {h['mean']:.3f} +- {h['half_width']:.3f} | "
            f"{t['mean']:.3f} +- {t['half_width']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [TRAIN_KEY, summary["val_key"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key in zip(axes, keys):
        for method, s in summary["methods"].items():
            c = s["curves"][key]
            if not c["step"]:
                continue
            lo = [m - (h if math.isfinite(h) else 0) for m, h in zip(c["mean"], c["half_width"])]
            hi = [m + (h if math.isfinite(h) else 0) for m, h in zip(c["mean"], c["half_width"])]
            (line,) = ax.plot(c["step"], c["mean"], label=f"{method} (lr {s['lr']:g})", linewidth=1.4)
            ax.fill_between(c["step"], lo, hi, color=line.get_color(), alpha=0.2)
        ax.set_title(f"{key}: mean +- 95% CI over {summary['seeds']} seeds")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(args)
    tuning: dict = {}
    chosen = {m: args.lrs[0] for m in args.methods}
    val_key = args.val_key
    if len(args.lrs) > 1:
        specs = [(m, lr, TUNE_SEED0 + k) for m in args.methods for lr in args.lrs for k in range(args.tune_seeds)]
        res = runner.run_all(specs)
        val_key = val_key or next((find_val_key(r) for r in res.values() if r and find_val_key(r)), None)
        for m in args.methods:
            scores = {}
            for lr in args.lrs:
                runs = [res[(m, lr, TUNE_SEED0 + k)] for k in range(args.tune_seeds)]
                s = [run_score(r, val_key) for r in runs if r]
                scores[f"{lr:g}"] = (
                    [sum(x[0] for x in s) / len(s), sum(x[1] for x in s) / len(s)] if s else [-1.0, -1.0]
                )
            tuning[m] = scores
            chosen[m] = float(max(scores, key=lambda k: tuple(-1.0 if math.isnan(v) else v for v in scores[k])))
            logger.info("tuning %s: %s -> lr %g", m, scores, chosen[m])
    # Seed-major order: a comparison cut short still has every method on its first seeds.
    specs = [(m, chosen[m], seed) for seed in range(args.seeds) for m in args.methods]
    res = runner.run_all(specs)
    val_key = val_key or next((find_val_key(r) for r in res.values() if r and find_val_key(r)), None)
    if val_key is None:
        raise RuntimeError("no run logged a val/*/pass@1 metric: set trainer.test_freq (and --val-key)")
    reported = {m: {seed: res[(m, chosen[m], seed)] for seed in range(args.seeds)} for m in args.methods}
    summary = summarise(args, tuning, chosen, reported, val_key)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(table(summary))
    plot(summary, out / "curves.png")
    logger.info("wrote %s, %s and %s\n%s", out / "summary.json", out / "summary.md", out / "curves.png", table(summary))
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the run config every run starts from")
    p.add_argument("--out", required=True, help="output folder (runs/, summary.json, curves.png)")
    p.add_argument("--methods", default="pacs,grpo,ppo", help=f"comma-separated, from {sorted(METHODS)}")
    p.add_argument("--seeds", type=int, default=5, help="reported seeds 0..S-1")
    p.add_argument("--tune-seeds", type=int, default=2, help="seeds 1000.. used only to pick each method's lr")
    p.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="comma-separated lr grid (one value: no tuning)")
    p.add_argument("--steps", type=int, default=0, help="trainer.total_steps of every run (0: the config's)")
    p.add_argument("--jobs", type=int, default=0, help="runs at a time (0: CPU cores // ranks per run)")
    p.add_argument("--val-key", default="", help="held-out metric (default: the first val/*/pass@1)")
    p.add_argument("--background", action="store_true", help="detach; log to OUT/compare.log")
    p.add_argument("overrides", nargs="*", help="a.b=c overrides applied to every run")


def main(args: argparse.Namespace) -> int:
    init_logging()
    args.methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        logger.error("--methods has %s: choose from %s", bad, sorted(METHODS))
        return 2
    args.lrs = [float(x) for x in str(args.lrs).split(",") if x]
    problem = check_validates(args)
    if problem:
        logger.error("%s", problem)
        return 2
    if args.background:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        argv = [a for a in sys.argv[1:] if a != "--background"]
        with (out / "compare.log").open("a") as log:
            cmd = [sys.executable, "-m", "pacs_megatron", *argv]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        logger.info("comparison running in the background (pid %d): tail -f %s", proc.pid, out / "compare.log")
        return 0
    if not args.jobs:
        from pacs_megatron.config import load_config

        cfg = load_config(args.config, args.overrides)
        ranks = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
        args.jobs = max(1, (os.cpu_count() or 1) // ranks)
    # SIGTERM (kill PID) unwinds like Ctrl-C, so Runner stops its runs: none is left going.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    compare(args)
    return 0
