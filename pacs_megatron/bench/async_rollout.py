"""Benchmark: step rate of the synchronous colocated loop vs engines on their own cores with k = 0, 1, ...,
at equal total cores, side by side in one run.

    python -m pacs_megatron.bench.async_rollout                        # the CPU default, 40 steps, 2 rounds
    python -m pacs_megatron.bench.async_rollout --steps 30 --rounds 3 --json async.json rollout.n=32

Every variant is a real training launch of the CPU default with the same number of one-thread processes:
``colocated`` (P ranks that generate and train in turn) and ``separate-kK`` (E engine cores, P - E trainer
cores, ``rollout.max_staleness=K``), interleaved over ``--rounds``. Reported per variant: the median step
time, the step-rate ratio to colocated, and the reward at the last step (a faster step that learns less is
no gain). Method and results: docs/benchmarks.md, "Step rate at equal cores".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pacs_megatron.run.layout import RunLayout
from pacs_megatron.utils.logging import get_logger, init_logging

logger = get_logger(__name__)
CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "cpu_tiny.yaml"
PHASES = ("timing/rollout_s", "timing/old_logprob_s", "timing/update_s", "timing/sync_s")
ASYNC = ("async/trainer_wait_s", "async/engine_busy_s", "async/engine_idle_s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=40, help="RL steps per launch")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the timing (start-up, k filling)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every variant")
    p.add_argument("--cores", type=int, default=2, help="processes (one thread each) of every variant")
    p.add_argument("--engines", type=int, default=1, help="engine processes of the separate variants")
    p.add_argument("--staleness", default="0,1,2", help="k of the separate variants")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--workdir", default=None, help="run directories (default: a temporary one)")
    p.add_argument("overrides", nargs="*", help="config overrides for every variant (a.b=c)")


def variants(cores: int, engines: int, staleness: list[int]) -> dict[str, list[str]]:
    if not 0 < engines < cores:
        raise SystemExit(f"--engines={engines} must leave trainer cores: 1 .. {cores - 1}")
    out = {"colocated": [f"parallel.tp={cores}"]}
    for k in staleness:
        out[f"separate-k{k}"] = [
            f"parallel.tp={cores - engines}",
            "rollout.placement=separate",
            f"rollout.engines={engines}",
            f"rollout.max_staleness={k}",
        ]
    return out


def launch(out: Path, steps: int, overrides: list[str]) -> list[dict]:
    """One training launch; its metrics rows."""
    cmd = [sys.executable, "-m", "pacs_megatron", "train", "--config", str(CONFIG), "--resume", "never"]
    cmd += [f"trainer.output_dir={out}", f"model.path={out}/model", f"trainer.total_steps={steps}"]
    cmd += ["trainer.save_freq=0", "trainer.test_freq=0", "logging.progress_bar=false", "logging.tensorboard=false"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*cmd, *overrides], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(overrides)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(x) for x in RunLayout(out).metrics.read_text().splitlines() if x.strip()]


def summarize(rows: list[dict], skip: int) -> dict:
    timed = rows[skip:] or rows
    med = {k: statistics.median(r.get(k, 0.0) for r in timed) for k in ("timing/step_s", *PHASES, *ASYNC)}
    return med | {"reward_last": rows[-1]["reward/mean"], "reward_mean_last10": statistics.mean(
        r["reward/mean"] for r in rows[-10:]
    )}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    ks = [int(k) for k in args.staleness.split(",") if k != ""]
    plan = variants(args.cores, args.engines, ks)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-async-"))
    rounds = []
    for r in range(args.rounds):
        results = {}
        for name, overrides in plan.items():
            results[name] = summarize(launch(root / f"r{r}-{name}", args.steps, overrides + args.overrides), args.skip)
            logger.info("round %d %s: step %.3f s", r, name, results[name]["timing/step_s"])
        base = results["colocated"]["timing/step_s"]
        for res in results.values():
            res["speedup_vs_colocated"] = base / res["timing/step_s"]
        rounds.append(results)
    report = {
        name: {key: statistics.median(rnd[name][key] for rnd in rounds) for key in rounds[0][name]} for name in plan
    }
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f} at the end",
        "args": {k: v for k, v in vars(args).items() if k != "workdir"},
        "variants": {name: plan[name] + args.overrides for name in plan},
        "median": report,
        "rounds": rounds,
    }


def render(result: dict) -> str:
    cols = ("step s", "speedup", "rollout", "old_lp", "update", "sync", "t_wait", "e_busy", "e_idle", "reward")
    lines = [f"{'variant':<13}" + "".join(f"{c:>9}" for c in cols)]
    for name, m in result["median"].items():
        vals = [m["timing/step_s"], m["speedup_vs_colocated"], *(m[p] for p in PHASES), *(m[a] for a in ASYNC)]
        lines.append(f"{name:<13}" + "".join(f"{v:>9.3f}" for v in vals) + f"{m['reward_mean_last10']:>9.3f}")
    return "\n".join(lines) + f"\n({result['machine']}; medians over {len(result['rounds'])} interleaved rounds)\n"


def main(args: argparse.Namespace) -> int:
    init_logging()
    result = run(args)
    sys.stdout.write(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
