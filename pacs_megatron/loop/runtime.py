"""What a training run holds besides the loop: the process layout, and the components built from
the config (dataset, actor, engine, reward scorer, weight sync), with their save and restore.

``setup`` runs first on every rank: process groups, output dir, the model directory (written for
the tiny synthetic model, imported for a GGUF file), seeds, and the checkpoint to resume from
(validated, model unchanged; see run/resume.py), before any heavy piece is built.
``build_components`` then builds the heavy pieces in data-flow order. Checkpoints hold the actor
(model, optimizer, scheduler, RNG; megatron dist_checkpointing) and the trainer's own state (step,
data position, resolved config, model shape) as ``extra_state``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from pacs_megatron.config import ConfigError, RunConfig
from pacs_megatron.loop.build import (
    build_actor,
    build_critic,
    build_rollout_engine,
    train_dataset,
    val_datasets,
    with_run_tools,
)
from pacs_megatron.run.launch_info import write_launch_json
from pacs_megatron.run.layout import StepLayout
from pacs_megatron.run.resume import ResumePlan, check_tiny_model_dir, model_shape, plan_resume
from pacs_megatron.utils.logging import get_logger, init_logging
from pacs_megatron.utils.shared_fs import missing_on, require_shared

if TYPE_CHECKING:  # the run's pieces; build_components imports them when it builds them
    from transformers import PreTrainedTokenizerBase

    from pacs_megatron.actor.actor import MegatronActor
    from pacs_megatron.actor.critic import MegatronCritic
    from pacs_megatron.data.records import PromptRecord
    from pacs_megatron.data.sampler import PromptDataset
    from pacs_megatron.parallel.groups import ParallelGroups
    from pacs_megatron.reward.scorer import RewardScorer
    from pacs_megatron.rollout.base import Generator
    from pacs_megatron.rollout.pipeline import InFlightPrompts
    from pacs_megatron.rollout.remote.engines import RemoteEngines
    from pacs_megatron.run.run_dir import RunDir
    from pacs_megatron.weight_sync.remote import RemoteWeightSync
    from pacs_megatron.weight_sync.sync import WeightSyncer

logger = get_logger(__name__)


@dataclass
class Runtime:
    """This process's place in the job."""

    groups: ParallelGroups
    """TP/PP/DP groups, ranks, device."""
    output_dir: Path
    """trainer.output_dir."""
    model_dir: Path
    """Hugging Face model directory (config.json, tokenizer, maybe weights)."""
    config_dict: dict
    """The resolved config as plain data (saved with the run and sent to wandb)."""
    resume: ResumePlan | None = None
    """The checkpoint this launch continues (None: a fresh run)."""
    run_dir: RunDir | None = None
    """The lock on output_dir, held by rank 0 until teardown (set by :func:`setup`)."""

    @property
    def is_rank0(self) -> bool:
        return self.groups.rank == 0


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_shared_dirs(cfg: RunConfig, output_dir: Path, model_dir: Path) -> None:
    """Collective: trainer.output_dir on a filesystem every rank sees (canary, utils/shared_fs.py);
    model.path too when rank 0 writes it (init=tiny or gguf), else present on every node (a copy per
    node's own disk is fine for a model that is only read)."""
    require_shared(output_dir, "trainer.output_dir")
    if cfg.model.written_by_run:
        require_shared(model_dir, "model.path")
        return
    missing = missing_on(model_dir / "config.json")
    if missing:
        raise ConfigError(
            f"model.path={model_dir} has no config.json on {', '.join(missing)}: put the model on a shared "
            "filesystem or copy it to the same path on every node"
        )


def setup(cfg: RunConfig) -> Runtime:
    """Process groups, output dir, model dir, seeds, resume plan. Collective. The run's config files
    are written later, once the run has really started (run/run_record.py)."""
    from pacs_megatron.parallel import init_distributed

    init_logging(cfg.logging.level)
    init_distributed(cfg.parallel)
    run_dir = claim_run_dir(cfg)  # before anything is written or loaded: one run per output_dir
    try:
        rt = _setup(cfg)
    except BaseException:
        run_dir.release()
        raise
    rt.run_dir = run_dir
    return rt


def claim_run_dir(cfg: RunConfig) -> RunDir:
    """Collective: rank 0 takes the output dir's lock (run/run_dir.py); every rank raises its refusal."""
    from pacs_megatron.run.run_dir import RunDir, RunDirError

    run_dir = RunDir.from_config(cfg)
    problem = None
    if dist.get_rank() == 0:
        try:
            run_dir.claim()
        except RunDirError as e:
            problem = str(e)
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise RunDirError(box[0])
    return run_dir


def write_model_dir(cfg: RunConfig, model_dir: Path) -> None:
    """Rank 0, first run: the tiny model's config + task tokenizer, or the import of ``model.gguf``."""
    if cfg.model.init == "gguf":
        from pacs_megatron.hf.gguf_import import import_gguf

        logger.info("importing %s into %s (first run; dequantized to fp32)", cfg.model.gguf, model_dir)
        import_gguf(cfg.model.gguf, model_dir)
        logger.info("imported %s into %s", cfg.model.gguf, model_dir)
        return
    from pacs_megatron.data.synthetic import write_tiny_model_dir

    write_tiny_model_dir(model_dir, cfg.model.tiny)
    logger.info("wrote the tiny model config and task tokenizer to %s", model_dir)


def _setup(cfg: RunConfig) -> Runtime:
    from pacs_megatron.parallel import initialize_parallel

    output_dir, model_dir = Path(cfg.trainer.output_dir), Path(cfg.model.path)
    if dist.get_rank() == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        if cfg.model.written_by_run and not (model_dir / "config.json").is_file():
            write_model_dir(cfg, model_dir)
    dist.barrier()
    check_shared_dirs(cfg, output_dir, model_dir)  # a node-local disk fails here, not at the first checkpoint
    check_tiny_model_dir(cfg)
    write_launch_json(output_dir)  # where every rank runs, for users and tests
    hf_config = json.loads((model_dir / "config.json").read_text())
    groups = initialize_parallel(cfg.parallel, hf_config)
    _seed_everything(cfg.trainer.seed)
    rt = Runtime(groups, output_dir, model_dir, OmegaConf.to_container(OmegaConf.structured(cfg)))
    rt.resume = plan_resume(cfg, rt.config_dict, hf_config)
    if rt.resume is not None and rt.is_rank0:
        changes = rt.resume.changes or ["(none)"]
        logger.info("resuming from %s; settings changed since it:\n  %s", rt.resume.path, "\n  ".join(changes))
    return rt


def teardown(rt: Runtime | None) -> None:
    from pacs_megatron.parallel import destroy_parallel

    if rt is not None and rt.run_dir is not None:
        rt.run_dir.release()
    destroy_parallel()


@dataclass
class Components:
    """The run's pieces, in data-flow order."""

    cfg: RunConfig
    rt: Runtime
    tokenizer: PreTrainedTokenizerBase
    dataset: PromptDataset | InFlightPrompts
    """The resumable, shuffled train stream (wrapped to checkpoint its batches in flight with separate engines)."""
    val_sets: dict[str, list[PromptRecord]]
    """name -> records for periodic validation."""
    actor: MegatronActor
    engine: Generator
    """A RolloutEngine in process (HF, vLLM), or the engine processes of rollout.placement=separate."""
    scorer: RewardScorer
    sync: WeightSyncer
    """Actor -> engine(s), verified: WeightSync in process, RemoteWeightSync to engine processes."""
    critic: MegatronCritic | None = None
    """The learned critic (algorithm.policy.adv_estimator=gae), else None."""

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    def save(self, directory: Path, step: int) -> None:
        """Collective: actor checkpoint with the trainer state; optional HF export."""
        extra = {
            "step": step,
            "dataset": self.dataset.state_dict(),
            "config": self.rt.config_dict,
            "model": model_shape(self.actor.hf_config.to_dict()),
        }
        if self.actor.reference is not None:  # the reset schedule (update_stages.reset_reference) resumes exactly
            extra["reference_reset_step"] = self.actor.reference.reset_step
        self.actor.save_checkpoint(str(directory), extra)
        if self.critic is not None:
            self.critic.save_checkpoint(str(StepLayout(directory).critic), {"step": step})
        if self.cfg.trainer.export_hf:
            self.export_hf(directory)

    def export_hf(self, directory: Path) -> None:
        """Collective: HF safetensors + config + tokenizer of the current weights into ``directory/hf``."""
        self.actor.save_hf(str(StepLayout(Path(directory)).hf))

    def restore(self, plan: ResumePlan | None) -> int:
        """Load the checkpoint of ``plan`` (None: fresh run) and return the last completed step."""
        if plan is None:
            return 0
        extra = self.actor.load_checkpoint(str(plan.path))
        if self.critic is not None:
            self.critic.load_checkpoint(str(StepLayout(plan.path).critic))
        self.dataset.load_state_dict(extra["dataset"])
        ref = self.actor.reference
        if ref is not None:  # a reference not in the checkpoint is the resumed policy: its age starts now
            ref.reset_step = int(extra.get("reference_reset_step", 0)) if ref.ready else int(extra["step"])
        logger.info("resumed from %s (step %d)", plan.path, extra["step"])
        return int(extra["step"])

    def close(self) -> None:
        self.scorer.close()
        self.engine.close()  # vLLM: tear its groups down while they still exist


def build_components(cfg: RunConfig, rt: Runtime) -> Components:
    """Tokenizer, datasets, actor, engine, scorer and weight sync (collective)."""
    from pacs_megatron.data import load_tokenizer
    from pacs_megatron.reward import RewardScorer
    from pacs_megatron.weight_sync import WeightSync
    from pacs_megatron.weight_sync.quantize import vllm_fp8_config

    template = cfg.data.chat_template if cfg.data.renders_prompts else "none"  # the raw arith prompts have none
    tokenizer = load_tokenizer(cfg.model.tokenizer or str(rt.model_dir), template)
    prompts = train_dataset(cfg, tokenizer)
    val_sets = val_datasets(cfg, tokenizer) if cfg.trainer.test_freq else {}
    actor = build_actor(cfg, rt.groups, rt.model_dir)
    dataset: PromptDataset | InFlightPrompts = prompts
    engine: Generator
    sync: WeightSyncer
    if cfg.rollout.placement == "separate":  # engines on their own ranks (docs/async.md)
        dataset, engine, sync = _separate_engines(cfg, rt, prompts, actor)
    else:
        # FP8 rollouts on vLLM: the sync tells the engine the layout of the weights it will send
        inner = build_rollout_engine(cfg, rt.model_dir, tokenizer, rt.groups.device, vllm_fp8_config(cfg.rollout))
        sync = WeightSync(actor, inner, cfg.sync, actor.hf_config.vocab_size, actor.param_dtype, cfg.rollout)
        # multi-turn rollouts: the turn loop over the engine, knowing which tools each prompt may call
        engine = with_run_tools(inner, cfg, tokenizer, [*prompts.records, *(r for v in val_sets.values() for r in v)])
    critic = build_critic(cfg, rt.groups, actor)
    return Components(cfg, rt, tokenizer, dataset, val_sets, actor, engine, RewardScorer(cfg.reward), sync, critic)


def _separate_engines(
    cfg: RunConfig, rt: Runtime, dataset: PromptDataset, actor: MegatronActor
) -> tuple[InFlightPrompts, RemoteEngines, RemoteWeightSync]:
    """Collective: connect to the engine processes the launcher started; the prompt stream that saves its
    in-flight batches as untrained, the remote engines, and the weight sync over the weight group."""
    from pacs_megatron.rollout.pipeline import InFlightPrompts
    from pacs_megatron.rollout.remote.engines import RemoteEngines
    from pacs_megatron.weight_sync.remote import RemoteWeightSync

    tokenizer_dir = Path(cfg.model.tokenizer or rt.model_dir).absolute()
    engine = RemoteEngines(cfg.rollout, Path(rt.model_dir).absolute(), tokenizer_dir, rt.config_dict, rt.groups.device)
    vocab, dtype = actor.hf_config.vocab_size, actor.param_dtype
    sync = RemoteWeightSync(actor, engine, cfg.sync, vocab, dtype, cfg.rollout, rt.groups.device)
    return InFlightPrompts(dataset), engine, sync
