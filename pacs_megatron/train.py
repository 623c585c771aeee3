"""The PACS training loop, one page: every line is a named stage from its own package.

for step:  prompts -> rollouts (engine) -> rewards -> old log-probs (actor, no grad)
           -> ppo_epochs x mini-batches of the loss (PACS / GRPO / PPO-clip) -> weight sync + probe
           -> metrics -> validation every test_freq -> checkpoint every save_freq / on SIGTERM
then the end-of-run summary (final.json). A run resumed when already complete says so and exits 0.
"""

from __future__ import annotations

import time
from dataclasses import replace

import psutil

from pacs_megatron import critic_stages, sampling_stages, stages
from pacs_megatron.config import RunConfig
from pacs_megatron.config.training import stop_deadline
from pacs_megatron.runtime import Components, Runtime, build_components, setup, teardown
from pacs_megatron.utils.checkpoint import CheckpointManager
from pacs_megatron.utils.logging import get_logger
from pacs_megatron.utils.memory import StepMemory
from pacs_megatron.utils.metrics import MetricsWriter, PhaseTimer, Progress, format_metrics
from pacs_megatron.utils.preemption import PreemptionFlag
from pacs_megatron.utils.run_record import RunRecord
from pacs_megatron.weight_sync import WeightSyncError

logger = get_logger(__name__)


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
    if start and start >= cfg.trainer.total_steps:  # nothing left to train
        if cfg.trainer.export_hf and not (rt.resume.path / "hf" / "config.json").is_file():
            c.export_hf(rt.resume.path)
        record.finish(start, rt.resume.path, status="already_complete")
        return 0
    record.write_launch()  # configs/launch_NNN.yaml + config.yaml, once the run has really started
    writer = MetricsWriter(
        rt.output_dir, rt.is_rank0, cfg.logging.tensorboard, cfg.logging.wandb_project, config=rt.config_dict
    )
    # Signals and the time budget: trainer.stop_after_s counts from the launch, so it becomes a deadline.
    launched = psutil.Process().create_time()
    flag = PreemptionFlag(replace(cfg.trainer, stop_after_s=0.0, deadline_unix=stop_deadline(cfg.trainer, launched)))
    writer.truncate_after(start)  # metrics, rollouts and TensorBoard end at the resumed step
    if rt.resume is None and cfg.trainer.sft_warmup_steps:
        logger.info("format warm-up: %s", format_metrics(stages.format_warmup(cfg, rt, c)))
        critic_stages.init_after_warmup(cfg, c)  # the critic starts from the warmed-up policy
    c.sync.sync()  # the engine starts from the actor's weights, verified
    if rt.resume is None and cfg.trainer.val_before_train:
        writer.truncate_after(-1)  # a restarted fresh run's earlier step-0 validation
        writer.log(0, stages.validate(cfg, c, 0))
    progress = Progress(cfg.trainer.total_steps, start, rt.is_rank0 and cfg.logging.progress_bar)

    step, memory = start, StepMemory(rt.groups.device)
    for step in range(start + 1, cfg.trainer.total_steps + 1):
        timer, t0 = PhaseTimer(), time.perf_counter()
        memory.start()
        with timer("rollout"):
            batch, metrics, samples = sampling_stages.collect_step(cfg, c, step)  # prompts, rollouts, rewards
            c.engine.sleep()  # colocated: free the engine's memory while the actor trains
        with timer("old_logprob"):
            local, m = stages.prepare_local_batch(cfg, c.actor, batch, rt.groups.dp_rank, rt.groups.dp_size)
            metrics |= m
            local, m = critic_stages.attach_values(cfg, c, local)  # GAE per row (ppo + learned critic)
            metrics |= m
        with timer("update"):
            metrics |= critic_stages.update_critic(cfg, c, local)
            metrics |= stages.update_actor(cfg, c.actor, local, rt.groups.dp_size)
            metrics |= c.actor.offload()  # actor.offload_during_rollout: optimizer state to host until next use
        with timer("sync"):
            try:
                metrics |= c.sync.sync().metrics()
            except WeightSyncError:  # the engine is wrong, the actor is not: keep its update, then stop
                ckpt.save(step, lambda d, s=step: c.save(d, s))
                raise
        if cfg.trainer.test_freq and step % cfg.trainer.test_freq == 0:
            with timer("eval"):
                metrics |= stages.validate(cfg, c, step)  # the engine stays awake: the next rollout uses it
        metrics |= timer.times | {"timing/step_s": time.perf_counter() - t0} | memory.metrics()
        metrics["perf/tokens_per_s"] = metrics["data/tokens"] / metrics["timing/step_s"]
        writer.log(step, metrics)
        stages.save_samples(rt, samples)
        progress.update(step, metrics)
        stop = flag.should_stop()
        if stop or step == cfg.trainer.total_steps or (cfg.trainer.save_freq and step % cfg.trainer.save_freq == 0):
            ckpt.save(step, lambda d, s=step: c.save(d, s))
        if stop and step < cfg.trainer.total_steps:  # a stop at the last step is a finished run
            flag.write_requeue_marker(step, cfg.trainer.total_steps)  # Slurm's script requeues from this file
            logger.warning("stopped after step %d (signal or time budget); resume with --resume auto", step)
            progress.close()
            writer.close()
            return flag.exit_code
    if step == 0 and rt.resume is None:  # total_steps=0: keep what the warm-up trained
        ckpt.save(0, lambda d: c.save(d, 0))
    progress.close()
    writer.close()
    summary = record.finish(step, ckpt.latest())  # the summary on rank 0, and final.json
    return 1 if rt.is_rank0 and summary.get("status") == "no_update" else 0
