"""``pacs-megatron compare``: PACS vs the baselines over seeds, each with its own tuned lr.

    pacs-megatron compare --config examples/configs/cpu_generalize.yaml --out /tmp/cmp \\
        --methods pacs,grpo,ppo --seeds 5 --tune-seeds 2 --lrs 3e-4,1e-3,3e-3 --critic-lrs 3e-4,1e-3 \\
        --tune-key val/arith_val/pass@1 --val-key val/arith_heldout/pass@1 --background

Protocol (fair by construction):

1. **Tune** (skipped with one lr): every method x lr runs on the *tuning* seeds (1000, 1001, ...),
   which are never reported. A run's score is the mean of ``--tune-key`` (a *validation* split,
   disjoint from the reported one) over its last three validations, ties broken by the mean train
   reward of its last quarter. Each method keeps its best lr. When the best lr is the grid's lowest or
   highest value, the grid grows on that side (1-3-10 steps, at most ``--max-extend`` values per side)
   until the optimum is interior; the summary says when it never became so. Methods with a learned
   critic (``ppo``) then tune the critic lr (``--critic-lrs``) the same way at their chosen actor lr;
   their actor-lr search runs at the middle of that grid (one coordinate pass, not a joint grid).
2. **Report**: every method at its lrs on seeds 0..S-1 (``trainer.seed``, ``model.seed``, ``data.seed``
   and ``rollout.seed`` all set to the seed; the splits, ``data.arith.split_seed``, are not), scored on
   ``--val-key`` (the held-out split).
3. **Summarise**: ``OUT/summary.json`` (settings, every tuning score, chosen lrs, per-seed scores, per-
   method values with 95% t-intervals over seeds, the per-step curves), ``OUT/summary.md`` (the final,
   per-seed and tuning tables) and ``OUT/curves.png`` (mean +- 95% interval of train reward and
   held-out pass@1 per method).

Each run is ``pacs-megatron train`` in its own process and output dir ``OUT/runs/NAME-KEY``, where KEY
hashes the run's resolved config (config file, overrides, ``--steps``, seed, lrs): a run with
``final.json`` is done *for those settings*; any other is (re)started and resumes from its own
checkpoint, so the whole command is resumable: rerun it with the same arguments; changed settings
(``--steps 6`` after ``--steps 4``) get new runs, never the old ones' results. At most ``--jobs`` runs
at a time (default: CPU cores // ranks per run). On GPUs, runs that share one are pinned to the least busy
and each process may hold 0.85 / (runs on it) of its memory (``PACS_CUDA_MEMORY_FRACTION``); a colocated vLLM
engine must ask for at most half of that (``rollout.vllm.gpu_memory_utilization``), else the command refuses.
``OUT/progress.json`` and the log show progress; ``--background`` detaches the command (log in ``OUT/compare.log``).

Before any run starts, the config must validate (``trainer.test_freq`` > 0 and <= the steps): the
comparison is scored on validations. Runs die with the command: SIGTERM / Ctrl-C stop them
(each checkpoints after its current step, however long it takes, so a rerun resumes; a second signal
kills them at once), and SIGKILL kills them (PR_SET_PDEATHSIG).
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
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from pacs_megatron.run.layout import RunLayout
from pacs_megatron.tools.compare_report import (
    FINAL_DEFINITION,
    find_val_key,
    interval,  # noqa: F401  (re-exported: the public helpers of this tool)
    method_summary,
    plot,
    run_score,
    table,
)
from pacs_megatron.tools.plot import read_metrics
from pacs_megatron.utils.devices import MEMORY_FRACTION_ENV, share_gpus, visible_gpus
from pacs_megatron.utils.logging import get_logger, init_logging
from pacs_megatron.utils.preemption import unwind_on_signals
from pacs_megatron.utils.proc import die_with_parent

logger = get_logger(__name__)

METHODS: dict[str, list[str]] = {
    "pacs": ["algorithm.loss=pacs"],
    "grpo": ["algorithm.loss=grpo", "algorithm.policy.adv_estimator=grpo"],
    # The paper's PPO baseline: GAE advantages from a learned critic.
    "ppo": ["algorithm.loss=ppo", "algorithm.policy.adv_estimator=gae"],
    # PPO-clip with the critic-free leave-one-out baseline (this project's earlier "ppo").
    "ppo_rloo": ["algorithm.loss=ppo", "algorithm.policy.adv_estimator=rloo"],
    # PACS v2: r anchored on a reference policy, hard-reset every 10 steps (the config's mini-batching).
    "pacs_v2": ["algorithm.loss=pacs", "algorithm.pacs.anchor=reference", "algorithm.reference_reset_every=10"],
    # The control: PACS with one update per rollout batch, where psi = 0 and the loss is class-weighted
    # REINFORCE with a leave-one-out baseline (README, "What PACS is").
    "reinforce": ["algorithm.loss=pacs", "algorithm.mini_batch_size=0"],
    # GSPO (sequence-level ratio; verl's defaults in algorithm.gspo: clip 3e-4 / 4e-4, GRPO advantages).
    "gspo": ["algorithm.loss=gspo"],
}
TUNE_SEED0 = 1000
TRAIN = (sys.executable, "-m", "pacs_megatron", "train")


def uses_critic(method: str) -> bool:
    return "algorithm.policy.adv_estimator=gae" in METHODS[method]


class Spec(NamedTuple):
    """One run: a method at an lr (and a critic lr for critic methods) on a seed."""

    method: str
    lr: float
    seed: int
    critic_lr: float | None = None


def run_name(method: str, lr: float, seed: int, critic_lr: float | None = None) -> str:
    critic = f"_clr{critic_lr:g}" if critic_lr is not None else ""
    return f"{method}_lr{lr:g}{critic}_s{seed}"


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


class Runner:
    """Launches ``pacs-megatron train`` runs, at most ``jobs`` at a time; resumable by final.json."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out)
        self.done = 0
        self.total = 0
        self._dirs: dict[tuple, Path] = {}
        self._builds_model: dict[tuple, bool] = {}
        # The cores are split between the runs going at once: torch's default (every core per process)
        # oversubscribes them, and OpenMP's spinning threads then cost several times the work (measured:
        # 2 runs x 2 threads on 2 cores ran 5x slower per step than one). The shell's value wins.
        threads = str(getattr(args, "threads_per_rank", 1))
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
        # Runs that share a GPU each keep to their share of its memory: on one H200, 12 SmolLM2 runs whose
        # caching allocators each grew to ~12.5 GB filled its 140 GB and 13 of 24 runs died of CUDA OOM
        # (2026-11-28). One-rank runs are pinned to the least busy GPU; larger ones see every GPU.
        ranks = getattr(args, "ranks_per_run", 1)
        self.gpus = visible_gpus() if getattr(args, "share_gpus", True) else []
        per_gpu, self.memory_fraction = share_gpus(getattr(args, "jobs", 1) or 1, ranks, self.gpus)
        self.pin = ranks == 1 and len(self.gpus) > 0
        self._gpu_of: dict[tuple, str] = {}
        if self.memory_fraction is not None:
            logger.info(
                "%d run(s) share each of %d GPU(s): each process may hold %.0f%% of its GPU's memory (%s)",
                per_gpu,
                len(self.gpus),
                100 * self.memory_fraction,
                MEMORY_FRACTION_ENV,
            )

    def settings(self, method: str, lr: float, seed: int, critic_lr: float | None = None) -> list[str]:
        """The overrides that make this run (all but its directories)."""
        return [
            *METHODS[method],
            f"optimizer.lr={lr}",
            *([f"critic.optim.lr={critic_lr}"] if critic_lr is not None else []),
            f"trainer.seed={seed}",
            f"model.seed={seed}",
            f"data.seed={seed}",
            f"rollout.seed={seed}",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            *([f"trainer.total_steps={self.args.steps}"] if self.args.steps else []),
            *self.args.overrides,
        ]

    def run_dir(self, method: str, lr: float, seed: int, critic_lr: float | None = None) -> Path:
        """``OUT/runs/NAME-KEY``: KEY hashes the resolved config, so other settings never reuse this run."""
        from pacs_megatron.config import load_config, to_yaml

        spec = Spec(method, lr, seed, critic_lr)
        if spec not in self._dirs:
            cfg = load_config(self.args.config, self.settings(*spec))
            key = hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:10]
            self._dirs[spec] = self.out / "runs" / f"{run_name(*spec)}-{key}"
            self._builds_model[spec] = cfg.model.init != "pretrained"
        return self._dirs[spec]

    def command(self, *spec) -> list[str]:
        d = self.run_dir(*spec)
        # A model the run builds (tiny, random, a GGUF import) goes into the run's own directory, so
        # concurrent runs never write one path; a pretrained model is read where the user put it.
        own_model = [f"model.path={d}/model"] if self._builds_model[Spec(*spec)] else []
        return [*TRAIN, f"--config={self.args.config}", *self.settings(*spec), f"trainer.output_dir={d}", *own_model]

    def run_all(self, specs: list[Spec]) -> dict[Spec, list[dict] | None]:
        """Run every spec not yet done; return each spec's metrics rows (None when it failed)."""
        specs = list(dict.fromkeys(Spec(*s) for s in specs))
        todo = [s for s in specs if not RunLayout(self.run_dir(*s)).final.is_file()]
        self.total += len(specs)
        self.done += len(specs) - len(todo)
        running: dict[Spec, tuple[subprocess.Popen, object]] = {}
        failed: set = set()
        try:
            self._run(todo, running, failed)
        finally:  # stopped (SIGTERM, Ctrl-C) or failed: the runs stop with the command
            _stop_runs(running)
        out = {}
        for spec in specs:
            d = self.run_dir(*spec)
            out[spec] = None if spec in failed or not RunLayout(d).metrics.is_file() else read_metrics(d)
        return out

    def _run(self, todo: list, running: dict, failed: set) -> None:
        while todo or running:
            while todo and len(running) < self.args.jobs:
                spec = todo.pop(0)
                d = self.run_dir(*spec)
                d.mkdir(parents=True, exist_ok=True)
                log = (d / "train.log").open("a")
                proc = subprocess.Popen(
                    self.command(*spec),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.run_env(spec),
                    preexec_fn=die_with_parent,
                )
                running[spec] = (proc, log)
                logger.info("started %s", run_name(*spec))
            time.sleep(1.0)
            for spec, (proc, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[spec]
                self._gpu_of.pop(spec, None)
                self.done += 1
                if proc.returncode != 0:
                    failed.add(spec)
                    logger.error("%s failed (exit %d): see its train.log", run_name(*spec), proc.returncode)
                logger.info("progress: %d/%d runs done", self.done, self.total)
                self._progress(list(running))

    def run_env(self, spec: tuple) -> dict[str, str]:
        """The environment of one run: the threads, and on GPUs its device and memory share."""
        env = dict(self.env)
        if self.memory_fraction is not None:
            env[MEMORY_FRACTION_ENV] = str(self.memory_fraction)
        if self.pin:
            busy = list(self._gpu_of.values())
            gpu = min(self.gpus, key=busy.count)  # the first of the least busy
            self._gpu_of[spec] = env["CUDA_VISIBLE_DEVICES"] = gpu
        return env

    def _progress(self, running: list[tuple]) -> None:
        state = {"done": self.done, "total": self.total, "running": [run_name(*s) for s in running]}
        (self.out / "progress.json").write_text(json.dumps(state, indent=1))


def _stop_runs(running: dict) -> None:
    """SIGTERM every run still going: each checkpoints after its current step and exits 143, however long
    that step takes (it was a fixed 120 s: a SmolLM2 step under load took 165 s, the run was killed and
    lost its steps). A second SIGTERM or Ctrl-C while waiting kills them at once."""
    if not running:
        return
    logger.warning(
        "stopping %d runs: each checkpoints after its current step (rerun the command to resume; a second "
        "Ctrl-C or SIGTERM kills them now)",
        len(running),
    )
    for proc, _ in running.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    try:
        for proc, _ in running.values():
            proc.wait()
    except (KeyboardInterrupt, SystemExit):
        for proc, _ in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        raise
    finally:
        for _, log in running.values():
            log.close()
        running.clear()


def check_validates(args: argparse.Namespace) -> str | None:
    """Why the runs would never validate (the comparison's score), or None: checked before any run starts."""
    from pacs_megatron.config import ConfigError, load_config
    from pacs_megatron.launch.device_checks import check_device

    steps = [f"trainer.total_steps={args.steps}"] if args.steps else []
    try:
        cfg = load_config(args.config, [*args.overrides, *steps])
        check_device(cfg)  # a quantization the device cannot run fails every run: say so before any starts
    except ConfigError as e:
        return str(e)
    t = cfg.trainer
    if not 0 < t.test_freq <= t.total_steps:
        return (
            f"compare scores held-out validations, but trainer.test_freq={t.test_freq} with trainer.total_steps="
            f"{t.total_steps} never validates: add trainer.test_freq=N (1 <= N <= {t.total_steps}) to the overrides"
        )
    return None


def compare(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(args)
    critic_lrs = args.critic_lrs or [None]
    mid_critic = sorted(critic_lrs, key=lambda x: x or 0.0)[len(critic_lrs) // 2]
    # Each method's current choice as a run spec (its seed is replaced per run).
    chosen = {m: Spec(m, args.lrs[0], 0, mid_critic if uses_critic(m) else None) for m in args.methods}
    tuning: dict = {m: {} for m in args.methods}
    val_key = args.val_key
    tune_key = args.tune_key or val_key
    if len(args.lrs) > 1 or len(critic_lrs) > 1:
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

        if len(args.lrs) > 1:
            for m, t in tune(
                runner, {m: args.lrs for m in args.methods}, actor_spec, tune_key, args.max_extend
            ).items():
                tuning[m]["lr"], chosen[m] = t, chosen[m]._replace(lr=t["chosen"])
        critics = [m for m in args.methods if uses_critic(m)]
        if len(critic_lrs) > 1 and critics:
            for m, t in tune(runner, {m: critic_lrs for m in critics}, critic_spec, tune_key, args.max_extend).items():
                tuning[m]["critic_lr"], chosen[m] = t, chosen[m]._replace(critic_lr=t["chosen"])
        logger.info("chosen (lr, critic lr): %s", {m: (c.lr, c.critic_lr) for m, c in chosen.items()})
    # Seed-major order: a comparison cut short still has every method on its first seeds.
    specs = [chosen[m]._replace(seed=seed) for seed in range(args.seeds) for m in args.methods]
    res = runner.run_all(specs)
    val_key = val_key or next((find_val_key(r) for r in res.values() if r and find_val_key(r)), None)
    if val_key is None:
        raise RuntimeError("no run logged a val/*/pass@1 metric: set trainer.test_freq (and --val-key)")
    tune_key = tune_key or val_key
    methods = {}
    for m in args.methods:
        results = {seed: res[chosen[m]._replace(seed=seed)] for seed in range(args.seeds)}
        methods[m] = {
            "lr": chosen[m].lr,
            "critic_lr": chosen[m].critic_lr,
            **method_summary(results, val_key, tune_key),
        }
    summary = {
        "config": args.config,
        "overrides": args.overrides,
        "steps": args.steps,
        "seeds": args.seeds,
        "tune_seeds": args.tune_seeds if any(tuning.values()) else 0,
        "lrs": args.lrs,
        "critic_lrs": args.critic_lrs,
        "val_key": val_key,
        "tune_key": tune_key,
        "final_definition": FINAL_DEFINITION,
        "tuning": {m: t for m, t in tuning.items() if t},
        "methods": methods,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    md = table(summary)
    (out / "summary.md").write_text(md)
    plot(summary, out / "curves.png")
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the run config every run starts from")
    p.add_argument("--out", required=True, help="output folder (runs/, summary.json, curves.png)")
    p.add_argument("--methods", default="pacs,grpo,ppo", help=f"comma-separated, from {sorted(METHODS)}")
    p.add_argument("--seeds", type=int, default=5, help="reported seeds 0..S-1")
    p.add_argument("--tune-seeds", type=int, default=2, help="seeds 1000.. used only to pick each method's lr")
    p.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="comma-separated lr grid (one value: no tuning)")
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
    p.add_argument("--background", action="store_true", help="detach; log to OUT/compare.log")
    p.add_argument("overrides", nargs="*", help="a.b=c overrides applied to every run")


def check_engine_share(cfg, fraction: float | None, jobs: int) -> None:
    """Runs sharing a GPU (``fraction`` of its memory each): a colocated vLLM engine sizes itself by
    ``rollout.vllm.gpu_memory_utilization`` of the *whole* GPU, beyond the cap the runs' allocators keep to,
    so more than the share is refused before any run starts (ConfigError naming the key and a value)."""
    from pacs_megatron.config import ConfigError

    if fraction is None or cfg.rollout.engine != "vllm" or cfg.actor.offload_during_rollout:
        return  # (with the offload vLLM takes actor.rollout_memory_fraction of what is free when it starts)
    if cfg.rollout.vllm.gpu_memory_utilization > fraction / 2:
        raise ConfigError(
            f"rollout.vllm.gpu_memory_utilization={cfg.rollout.vllm.gpu_memory_utilization} with --jobs {jobs} "
            f"sharing a GPU: each run may hold {fraction:.3f} of it, its actor included; set "
            f"rollout.vllm.gpu_memory_utilization={fraction / 2:.3f} (or fewer --jobs, or rollout.engine=hf)"
        )


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
    for flag, value, least in (
        ("--seeds", args.seeds, 1),
        ("--tune-seeds", args.tune_seeds, 1),
        ("--steps", args.steps, 0),
        ("--jobs", args.jobs, 0),
        ("--max-extend", args.max_extend, 0),
    ):
        if value < least:
            raise ConfigError(f"{flag} {value} must be >= {least}")
    check_writable_dir("--out", args.out)
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

    cfg = load_config(args.config, args.overrides)
    ranks = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    args.jobs = args.jobs or max(1, (os.cpu_count() or 1) // ranks)
    args.threads_per_rank = max(1, (os.cpu_count() or 1) // (args.jobs * ranks))
    args.ranks_per_run = ranks
    check_engine_share(cfg, share_gpus(args.jobs, ranks, visible_gpus())[1], args.jobs)
    # SIGTERM (kill PID) unwinds like Ctrl-C, so Runner stops its runs: none is left going. A second one
    # kills them all at once, even while this process waits in a native call (utils/preemption.py).
    unwind_on_signals("the runs' current steps were not saved (rerun the command to resume them)")
    compare(args)
    return 0
