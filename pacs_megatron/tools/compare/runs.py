"""The runs of ``pacs-megatron compare`` (protocol.py): one ``pacs-megatron train`` process per (method,
lr, seed), at most ``--jobs`` at a time, each in its own directory keyed on its resolved config, so a rerun
resumes or reuses it. On GPUs, runs that share one are pinned to the least busy and capped at their share of
its memory (utils/devices.py); a colocated vLLM engine must fit inside that share (:func:`check_engine_share`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from pacs_megatron.run.layout import RunLayout
from pacs_megatron.tools.compare.results import ResultsDir
from pacs_megatron.tools.plot import read_metrics
from pacs_megatron.utils.devices import MEMORY_FRACTION_ENV, share_gpus, visible_gpus
from pacs_megatron.utils.logging import get_logger
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
    # PACS with LoRA adapters (r 16, alpha 32, the four linears) on the frozen base: issue 43's LoRA-vs-full
    # learning curve. LoRA wants its own lr grid (PEFT practice: ~10x the full lr): --method-lrs.
    "pacs_lora": ["algorithm.loss=pacs", "actor.lora.rank=16", "actor.lora.alpha=32"],
    # GSPO (sequence-level ratio; verl's defaults in algorithm.gspo: clip 3e-4 / 4e-4, GRPO advantages).
    "gspo": ["algorithm.loss=gspo"],
}
TRAIN = (sys.executable, "-m", "pacs_megatron", "train")
HEADROOM = 1.25
"""CPU runs: a run's host memory is taken as this times the most a run of the comparison has logged: a run's first
step logs ~80% of its later peak (docs/benchmarks.md, "How compare sizes concurrent runs")."""


def uses_critic(method: str) -> bool:
    return "algorithm.policy.adv_estimator=gae" in METHODS[method]


def uses_reference_anchor(method: str) -> bool:
    return "algorithm.pacs.anchor=reference" in METHODS[method]


class Spec(NamedTuple):
    """One run: a method at an lr (and a critic lr for critic methods, a reset period K for PACS v2's
    reference anchor; None: the config's) on a seed."""

    method: str
    lr: float
    seed: int
    critic_lr: float | None = None
    reset_every: int | None = None


def run_name(method: str, lr: float, seed: int, critic_lr: float | None = None, reset_every: int | None = None) -> str:
    critic = f"_clr{critic_lr:g}" if critic_lr is not None else ""
    k = f"_k{reset_every}" if reset_every is not None else ""
    return f"{method}_lr{lr:g}{critic}{k}_s{seed}"


class Runner:
    """Launches ``pacs-megatron train`` runs, at most ``jobs`` at a time; resumable by final.json."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out)
        self.done = 0
        self.total = 0
        self._dirs: dict[tuple, Path] = {}
        self._builds_model: dict[tuple, bool] = {}
        # The cores are split between the runs going at once: torch's default (every core per process)
        # oversubscribes them (docs/benchmarks.md, "How compare sizes concurrent runs"). The shell's value wins.
        threads = str(getattr(args, "threads_per_rank", 1))
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
        # Runs that share a GPU each keep to their share of its memory (unbounded caching allocators ran a
        # shared GPU out of memory). One-rank runs are pinned to the least busy GPU; larger ones see every GPU.
        ranks = getattr(args, "ranks_per_run", 1)
        self.gpus = args.gpus if hasattr(args, "gpus") else visible_gpus()
        per_gpu, self.memory_fraction = share_gpus(getattr(args, "jobs", 1) or 1, ranks, self.gpus)
        self.pin = ranks == 1 and len(self.gpus) > 0
        self._gpu_of: dict[tuple, str] = {}
        self._memory_wait = False  # a "waits for memory" line was logged and no run has started since
        self.results = ResultsDir(args.results) if getattr(args, "results", "") else None
        self.pending: set[Spec] = set()  # --report-only: the runs not finished yet (not run, not failed)
        if self.memory_fraction is not None:
            logger.info(
                "%d run(s) share each of %d GPU(s): each process may hold %.0f%% of its GPU's memory (%s)",
                per_gpu,
                len(self.gpus),
                100 * self.memory_fraction,
                MEMORY_FRACTION_ENV,
            )

    def settings(
        self, method: str, lr: float, seed: int, critic_lr: float | None = None, reset_every: int | None = None
    ) -> list[str]:
        """The overrides that make this run (all but its directories); a tuned K comes last, so it wins."""
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
            *([f"algorithm.reference_reset_every={reset_every}"] if reset_every is not None else []),
        ]

    def run_dir(self, *spec_fields) -> Path:
        """``OUT/runs/NAME-KEY``: KEY hashes the resolved config, so other settings never reuse this run."""
        from pacs_megatron.config import load_config

        spec = Spec(*spec_fields)
        if spec not in self._dirs:
            cfg = self._resolved(load_config(self.args.config, self.settings(*spec)), spec.seed)
            key = config_key(cfg)
            self._dirs[spec] = self.out / "runs" / f"{run_name(*spec)}-{key}"
            self._builds_model[spec] = cfg.model.init != "pretrained"
            if not self._dirs[spec].exists():
                self._adopt(spec, cfg, self._dirs[spec])
        return self._dirs[spec]

    def _resolved(self, cfg: Any, seed: int | None = None) -> Any:
        """``cfg`` with ``model.dtype=auto`` resolved, so the key says what the run computes in: an fp32 run of one
        machine is never reused as a bf16 run of another. A seed's block keeps the dtype it began in
        (:meth:`block_dtype`), so its remaining runs pair with its finished ones on any machine; a fresh block takes
        this machine's (launch/dtype.py: bf16 on a GPU or a native-bf16 CPU, fp32 elsewhere). An explicit dtype is
        keyed as given."""
        from pacs_megatron.launch.dtype import choose_dtype
        from pacs_megatron.utils.cpu import cpu_bf16_flags

        if cfg.model.dtype == "auto":
            began = self.block_dtype(seed) if seed is not None else None
            cfg.model.dtype = began or choose_dtype("auto", on_gpu=bool(self.gpus), bf16_flags=cpu_bf16_flags()).dtype
        return cfg

    def block_dtype(self, seed: int) -> str | None:
        """The dtype seed ``seed``'s block began in: the saved config of any of its runs, committed in --results or
        begun in --out (the earliest saved), None when none has begun."""
        from omegaconf import OmegaConf

        folders = [self.out / "runs", *([self.results.path / "runs"] if self.results else [])]
        saved = [RunLayout(d).config for f in folders if f.is_dir() for d in f.glob(f"*_s{seed}-*")]
        saved = [c for c in saved if c.is_file()]
        dtypes = [str(OmegaConf.load(c).model.dtype) for c in sorted(saved, key=lambda c: c.stat().st_mtime)]
        return next((d for d in dtypes if d != "auto"), None)  # a launch saves the resolved one

    def _adopt(self, spec: Spec, cfg: Any, new: Path) -> None:
        """A finished run of the same settings under another key (the key's scheme changed since: it once
        hashed every field, so each field a version added changed every key) is renamed to this key, so a
        long protocol's results (on a GPU lease, its minutes) are reused rather than run again."""
        from pacs_megatron.config import ConfigError, load_config

        kept = [self.results.kept(new).root.parent] if self.results else []  # committed runs are re-keyed there
        for old in sorted(p for folder in [new.parent, *kept] for p in folder.glob(f"{run_name(*spec)}-*")):
            saved = RunLayout(old).config
            if not (saved.is_file() and RunLayout(old).final.is_file()):
                continue
            # its own dirs aside (the output dir, and the model a run builds there), the run's saved config
            # must give this run's key
            own = [f"trainer.output_dir={cfg.trainer.output_dir}"]
            own += [f"model.path={cfg.model.path}"] if cfg.model.init != "pretrained" else []
            try:
                stored = self._resolved(load_config(saved, own))
            except ConfigError:
                continue  # a config this version cannot read: not the same settings
            if config_key(stored) == new.name.rsplit("-", 1)[1]:
                if old.name == new.name:
                    return  # committed under this very key: restore() copies it back
                old.rename(old.parent / new.name)
                logger.info("%s: the finished run %s has these settings (an older key): reused", new.name, old.name)
                return

    def command(self, *spec) -> list[str]:
        d = self.run_dir(*spec)
        # A model the run builds (tiny, random, a GGUF import) goes into the run's own directory, so
        # concurrent runs never write one path; a pretrained model is read where the user put it.
        own_model = [f"model.path={d}/model"] if self._builds_model[Spec(*spec)] else []
        return [*TRAIN, f"--config={self.args.config}", *self.settings(*spec), f"trainer.output_dir={d}", *own_model]

    def restore(self, spec: Spec) -> None:
        """With ``--results``: a finished run of these settings found there is put back in its run dir."""
        if self.results:
            self.results.restore(self.run_dir(*spec))

    def run_all(self, specs: list[Spec]) -> dict[Spec, list[dict] | None]:
        """Run every spec not yet done; return each spec's metrics rows (None when it failed)."""
        specs = list(dict.fromkeys(Spec(*s) for s in specs))
        for s in specs:
            self.restore(s)
        todo = [s for s in specs if s not in self.pending and not RunLayout(self.run_dir(*s)).final.is_file()]
        self.total += len(specs)
        self.done += len(specs) - len(todo)
        running: dict[Spec, tuple[subprocess.Popen, object]] = {}
        failed: set = set()
        if getattr(self.args, "report_only", False):  # summarise what has finished; start nothing
            self.pending |= set(todo)
            todo = []
        try:
            self._run(todo, running, failed)
        finally:  # stopped (SIGTERM, Ctrl-C) or failed: the runs stop with the command
            _stop_runs(running)
        out = {}
        for spec in specs:
            d = self.run_dir(*spec)
            done = spec not in failed and spec not in self.pending and RunLayout(d).metrics.is_file()
            out[spec] = read_metrics(d) if done else None
        return out

    def _run(self, todo: list, running: dict, failed: set) -> None:
        while todo or running:
            while todo and len(running) < self.args.jobs and self._host_memory_allows(running):
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
                elif self.results:
                    self.results.publish(self.run_dir(*spec))
                logger.info("progress: %d/%d runs done", self.done, self.total)
                self._progress(list(running))

    def _host_memory_allows(self, running: dict) -> bool:
        """CPU runs: one more starts beside the running ones only when the host's available memory holds it and
        the growth still to come of the running ones, each taken at HEADROOM x the most host memory a run of this
        comparison has logged (the sum of its ranks' ``perf/peak_rss_gb_rank*``). Until a run has logged a
        step that size is unknown and the next run waits for it. Two SmolLM2 runs (10-12 GB each) started
        together on a 24 GB box otherwise; on GPUs the runs' device shares are what is capped."""
        if self.gpus or not running:
            return True
        logged = [gb for d in self._dirs.values() if (gb := _logged_gb(d)) is not None]
        if not logged:
            return False
        need = HEADROOM * max(logged)
        growth = sum(max(0.0, need - _tree_gb(proc)) for proc, _ in running.values())
        free = psutil.virtual_memory().available / 1e9
        if free >= need + growth:
            self._memory_wait = False
            return True
        if not self._memory_wait:
            logger.info("the next run waits for memory: %.1f GB available, %.1f GB asked (a run ~%.1f GB, the "
                        "running ones' growth %.1f GB)", free, need + growth, need, growth)  # fmt: skip
            self._memory_wait = True
        return False

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


def _logged_gb(run_dir: Path) -> float | None:
    """The most host memory one step of the run has held (GB, all its ranks), or None before its first step."""
    if not RunLayout(run_dir).metrics.is_file():
        return None
    rows = read_metrics(run_dir)
    gb = [sum(v for k, v in r.items() if k.startswith("perf/peak_rss_gb_rank")) or r.get("perf/peak_rss_gb", 0.0)
          for r in rows]  # fmt: skip
    return max(gb, default=None)


def _tree_gb(proc: subprocess.Popen) -> float:
    """Resident memory (GB) of a run's process and its children now (0 once it has exited)."""
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 1e9


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


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    return {k: v for key, sub in d.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}


def config_key(cfg: Any) -> str:
    """10 hex digits of the settings of ``cfg`` that differ from the defaults. A field a later version adds
    with its default leaves the key (and so a protocol's finished runs, days of CPU) as it was; any setting
    that changes what a run computes changes it."""
    from omegaconf import OmegaConf

    from pacs_megatron.config import RunConfig

    ours = _flat(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    base = _flat(OmegaConf.to_container(OmegaConf.structured(RunConfig()), resolve=True))
    diff = sorted((k, repr(v)) for k, v in ours.items() if k not in base or base[k] != v)
    return hashlib.sha256(repr(diff).encode()).hexdigest()[:10]


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
