"""The PACS training loop, one page: every line is a named stage from its own package.

for step:  prompts -> rollouts (engine) -> rewards -> old log-probs (actor, no grad)
           -> ppo_epochs x mini-batches of the loss (PACS / GRPO / PPO-clip) -> weight sync + probe
           -> metrics -> validation every test_freq -> checkpoint every save_freq / on SIGTERM
then the end-of-run summary (final.json). A run resumed when already complete says so and exits 0.

One loop over a rollout source chosen once (sources.py). Colocated engines: generate, train, sync, in turn.
Separate engines (rollout.placement=separate, docs/async.md): they generate the next k =
rollout.max_staleness steps while the trainer trains, as slime's train_async.py: only where the
rollouts come from and when the weights leave differ, and the source hides both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

import psutil

from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.config import RunConfig
from pacs_megatron.config.training import stop_deadline
from pacs_megatron.loop import critic_stages, stages, update_stages, warmup
from pacs_megatron.loop.runtime import Components, Runtime, build_components, setup, teardown
from pacs_megatron.loop.sources import RolloutSource, rollout_source
from pacs_megatron.run.checkpoint import CheckpointManager
from pacs_megatron.run.layout import StepLayout
from pacs_megatron.run.metrics import MetricsWriter, PhaseTimer, Progress, format_metrics
from pacs_megatron.run.run_record import RunRecord
from pacs_megatron.utils.logging import get_logger
from pacs_megatron.utils.memory import StepMemory
from pacs_megatron.utils.preemption import PreemptionFlag
from pacs_megatron.weight_sync import WeightSyncError

logger = get_logger(__name__)
T = TypeVar("T")


def train(cfg: RunConfig) -> int:
    rt: Runtime = setup(cfg)
    c = None
    try:
        c = build_components(cfg, rt)  # dataset, actor, engine, scorer, weight sync, validation sets
        return _loop(cfg, rt, c)
    finally:
        if c is not None:
            c.close()
        teardown(rt)


def _loop(cfg: RunConfig, rt: Runtime, c: Components) -> int:
    ckpt = CheckpointManager(rt.output_dir, cfg.trainer.keep_checkpoints)
    record = RunRecord(cfg, rt.output_dir, rt.is_rank0, rt.resume)
    start = c.restore(rt.resume)  # step to start from; 0 for a fresh run
    if rt.resume is not None and start and start >= cfg.trainer.total_steps:  # nothing left to train
        done = rt.resume.path
        if cfg.trainer.export_hf and not (StepLayout(done).hf / "config.json").is_file():
            c.export_hf(done)
        record.finish(start, done, status="already_complete")
        return 0
    record.write_launch()  # configs/launch_NNN.yaml + config.yaml, once the run has really started
    writer = MetricsWriter(
        rt.output_dir, rt.is_rank0, cfg.logging.tensorboard, cfg.logging.wandb_project, config=rt.config_dict
    )
    # Signals and the time budget: trainer.stop_after_s counts from the launch, so it becomes a deadline.
    launched = psutil.Process().create_time()
    flag = PreemptionFlag(replace(cfg.trainer, stop_after_s=0.0, deadline_unix=stop_deadline(cfg.trainer, launched)))
    writer.truncate_after(start)  # metrics, rollouts and TensorBoard end at the resumed step
    warmed: dict = {}
    if rt.resume is None and cfg.trainer.sft_warmup_steps:
        warmed = warmup.format_warmup(cfg, rt, c)
        kind = "tool" if cfg.rollout.multi_turn.enabled else "format"  # warmup.format_warmup runs either
        logger.info("%s warm-up: %s", kind, format_metrics(warmed))
        critic_stages.init_after_warmup(cfg, c)  # the critic starts from the warmed-up policy
    c.sync.sync(version=start)  # the engines start from the actor's weights (policy version = step), verified
    # the tools' sandbox level and limits: final.json (this launch) and a fresh run's first row (step 0)
    record.tool_sandbox, first = stages.tool_sandbox(cfg)
    first |= warmup.stop_record(warmed)  # how long a measured warm-up ran and where it stopped
    if rt.resume is None and (first or cfg.trainer.val_before_train):
        writer.truncate_after(-1)  # a restarted fresh run's earlier step-0 row
        writer.log(0, first | (stages.validate(cfg, c, 0) if cfg.trainer.val_before_train else {}))
    progress = Progress(cfg.trainer.total_steps, start, rt.is_rank0 and cfg.logging.progress_bar)
    run = _Run(cfg, rt, c, ckpt, writer, flag, progress, StepMemory(rt.groups.device))
    step, stopped = _steps(run, start, rollout_source(cfg, c, start))
    if stopped is not None:
        return stopped
    if step == 0 and rt.resume is None:  # total_steps=0: keep what the warm-up trained
        ckpt.save(0, lambda d: c.save(d, 0))
    progress.close()
    writer.close()
    summary = record.finish(step, ckpt.latest())  # the summary on rank 0, and final.json
    return 1 if rt.is_rank0 and summary.get("status") == "no_update" else 0


@dataclass
class _Run:
    """What every step needs besides the stages."""

    cfg: RunConfig
    rt: Runtime
    c: Components
    ckpt: CheckpointManager
    writer: MetricsWriter
    flag: PreemptionFlag
    progress: Progress
    memory: StepMemory
    """perf/peak_rss_gb*: each step's own high-water mark (started by the loops, read in _end_step)."""


def _steps(run: _Run, start: int, source: RolloutSource) -> tuple[int, int | None]:
    """Rollouts, update, weights out, validation, end of step. Returns (last step, exit code when stopped
    early else None)."""
    cfg, c = run.cfg, run.c
    step = start
    for step in range(start + 1, cfg.trainer.total_steps + 1):
        timer, t0 = PhaseTimer(), time.perf_counter()
        run.memory.start()
        # Separate engines: async/trainer_wait_s of the rollout phase is waiting for them, and their verify of
        # the weights pushed after step - 1 may fail there: keep that step's update, as a sync does.
        with timer("rollout"):
            trained = step - 1 if step - 1 > start else None
            batch, metrics, samples = _synced(run, trained, source.take, step)
        metrics |= _update(run, batch, timer, step)
        with timer("sync"):
            metrics |= _synced(run, step, source.push, step)
        if cfg.trainer.validates_at(step):  # every test_freq steps and at the last
            # Colocated: the engine stays awake for the next rollout; separate: the requests queue behind the
            # batches in flight.
            with timer("eval"):
                metrics |= stages.validate(cfg, c, step)
        source.step_done(step)
        stopped = _end_step(run, step, metrics, samples, timer, t0)
        if stopped is not None:
            return step, stopped
    return step, None


def _update(run: _Run, batch: Rollouts, timer: PhaseTimer, step: int) -> dict:
    """Old (proximal) log-probs, then the critic and actor updates (and the reference's reset when due)."""
    cfg, rt, c = run.cfg, run.rt, run.c
    with timer("old_logprob"):
        gae = critic_stages.advantages_of(cfg, c)  # ppo + learned critic: GAE per row; else outcome advantages
        rows, old, metrics = update_stages.prepare_local_batch(
            cfg, c.actor, batch, rt.groups.dp_rank, rt.groups.dp_size, gae
        )
    with timer("update"):
        metrics |= critic_stages.update_critic(cfg, c, rows)
        metrics |= update_stages.update_actor(cfg, c.actor, rows, old, rt.groups.dp_size)
        metrics |= update_stages.reset_reference(cfg, c.actor, step)  # algorithm.reference_reset_every
        metrics |= c.actor.offload()  # actor.offload_during_rollout: optimizer state to host until next use
    return metrics


def _synced(run: _Run, step: int | None, sync: Callable[..., T], *args: Any) -> T:
    """``sync(*args)``; on a WeightSyncError, checkpoint ``step`` (the last trained one; None: nothing
    trained since the start) and re-raise."""
    try:
        return sync(*args)
    except WeightSyncError:  # the engine is wrong, the actor is not: keep its update, then stop
        if step is not None:
            run.ckpt.save(step, partial(run.c.save, step=step))
        raise


def _end_step(run: _Run, step: int, metrics: dict, samples: list, timer: PhaseTimer, t0: float) -> int | None:
    """Log the step, checkpoint when due; the exit code when a signal or the time budget stops the run."""
    cfg, c = run.cfg, run.c
    metrics |= timer.times | {"timing/step_s": time.perf_counter() - t0} | run.memory.metrics()
    metrics["perf/tokens_per_s"] = metrics["data/tokens"] / metrics["timing/step_s"]
    run.writer.log(step, metrics)
    run.writer.log_samples(samples)
    run.progress.update(step, metrics)
    stop = run.flag.should_stop()
    if stop or step == cfg.trainer.total_steps or (cfg.trainer.save_freq and step % cfg.trainer.save_freq == 0):
        run.ckpt.save(step, partial(c.save, step=step))
    if stop and step < cfg.trainer.total_steps:  # a stop at the last step is a finished run
        run.flag.write_requeue_marker(step, cfg.trainer.total_steps)  # Slurm's script requeues from this file
        logger.warning("stopped after step %d (signal or time budget); resume with --resume auto", step)
        run.progress.close()
        run.writer.close()
        return run.flag.exit_code
    return None
