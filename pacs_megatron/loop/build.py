"""Where the run config stops: the library's components built from the sections of a ``RunConfig``.

    actor = build_actor(cfg, groups, model_dir)          # MegatronActor(actor_sections(cfg), groups, model_dir)
    critic = build_critic(cfg, groups, actor)            # None unless the loss trains one (adv_estimator=gae)
    engine = with_run_tools(build_rollout_engine(cfg, model_dir, tok, device), cfg, tok, records)

Below loop/ every component takes the sections it reads (actor/sections.py, ...); these functions are the one
place that picks them out of a run config, for the loop, the launchers, the benches and the tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pacs_megatron.config import RolloutConfig, RunConfig, critic_enabled

if TYPE_CHECKING:  # the heavy pieces are imported when they are built
    import torch

    from pacs_megatron.actor.actor import MegatronActor
    from pacs_megatron.actor.critic import MegatronCritic
    from pacs_megatron.actor.sections import ActorSections, TrainView
    from pacs_megatron.data.factory import PromptRun
    from pacs_megatron.data.records import PromptRecord
    from pacs_megatron.data.sampler import PromptDataset
    from pacs_megatron.parallel.groups import ParallelGroups
    from pacs_megatron.rollout.base import RolloutEngine
    from pacs_megatron.rollout.engine_run import EngineRun


def train_view(cfg: RunConfig) -> TrainView:
    """The run-wide values the actor's training reads (the loss, batching, temperature, lengths, schedule)."""
    from pacs_megatron.actor.sections import TrainView

    return TrainView.of(cfg.algorithm, cfg.rollout, cfg.data, cfg.trainer)


def actor_sections(cfg: RunConfig) -> ActorSections:
    """The sections of ``cfg`` the policy is built from."""
    from pacs_megatron.actor.sections import ActorSections

    return ActorSections(cfg.model, cfg.parallel, cfg.actor, cfg.optimizer, train_view(cfg))


def build_actor(cfg: RunConfig, groups: ParallelGroups, model_dir: str | Path) -> MegatronActor:
    """The run's policy of ``model_dir`` on ``groups`` (collective)."""
    from pacs_megatron.actor.actor import MegatronActor

    return MegatronActor(actor_sections(cfg), groups, str(model_dir))


def build_critic(cfg: RunConfig, groups: ParallelGroups, actor: MegatronActor) -> MegatronCritic | None:
    """The run's learned critic beside ``actor`` (collective), or None when the policy loss needs none."""
    from pacs_megatron.actor.critic import MegatronCritic

    return MegatronCritic(cfg.critic, groups, actor) if critic_enabled(cfg) else None


def engine_run(cfg: RunConfig) -> EngineRun:
    """What an engine of ``cfg`` reads beyond ``rollout:`` (rollout/engine_run.py)."""
    from pacs_megatron.rollout.engine_run import EngineRun

    lora = cfg.actor.lora if cfg.sync.lora == "adapter" else None  # vLLM serves the adapters the sync sends
    return EngineRun(
        dtype=cfg.model.dtype,
        max_prompt_length=cfg.data.max_prompt_length,
        record_routing=cfg.actor.routing_replay == "rollout",
        offload_actor=cfg.actor.offload_during_rollout,
        memory_fraction=cfg.actor.rollout_memory_fraction,
        adapter_rank=lora.rank if lora is not None else 0,
        adapter_targets=tuple(lora.targets) if lora is not None else (),
    )


def engine_args(cfg: RunConfig) -> tuple[RolloutConfig, EngineRun]:
    """``(rollout, run)``: the first two arguments of an engine of ``cfg`` (``VLLMEngine``, ``llm_kwargs``)."""
    return cfg.rollout, engine_run(cfg)


def build_rollout_engine(
    cfg: RunConfig,
    model_dir: str | Path,
    tokenizer: Any,
    device: str | torch.device,
    fp8_config: dict[str, Any] | None = None,
) -> RolloutEngine:
    """The engine ``cfg.rollout.engine`` names (rollout/__init__.py ``build_engine``), for ``cfg``'s policy."""
    from pacs_megatron.rollout import build_engine

    return build_engine(cfg.rollout, engine_run(cfg), model_dir, tokenizer, device, fp8_config)


def with_run_tools(engine: Any, cfg: RunConfig, tokenizer: Any, records: Iterable[PromptRecord] = ()) -> Any:
    """``engine``, or with ``rollout.multi_turn`` the turn loop over it with ``cfg``'s tools (rollout/multi_turn.py)."""
    from pacs_megatron.rollout.multi_turn import uses_chat_template, with_tools

    chat = uses_chat_template(cfg.data)
    return with_tools(engine, cfg.rollout.multi_turn, cfg.tools, chat, tokenizer, records)


def prompt_run(cfg: RunConfig) -> PromptRun:
    """What the data factory reads of ``cfg`` beyond ``data:``: the prompts' tools, the validation sets' cut."""
    from pacs_megatron.data.factory import PromptRun

    multi_turn = cfg.rollout.multi_turn
    return PromptRun(
        instruction=multi_turn.instruction if multi_turn.enabled else "",
        tools=cfg.tools if multi_turn.enabled else None,
        val_max_problems=cfg.trainer.val_max_problems,
        val_sets=tuple(cfg.trainer.val_sets),
    )


def train_dataset(cfg: RunConfig, tokenizer: Any) -> PromptDataset:
    """The run's train stream (data/factory.py ``build_train_dataset``)."""
    from pacs_megatron.data.factory import build_train_dataset

    return build_train_dataset(cfg.data, tokenizer, prompt_run(cfg))


def val_datasets(cfg: RunConfig, tokenizer: Any) -> dict[str, list[PromptRecord]]:
    """The run's validation sets by name (data/factory.py ``build_val_datasets``)."""
    from pacs_megatron.data.factory import build_val_datasets

    return build_val_datasets(cfg.data, tokenizer, prompt_run(cfg))


def prompt_records(cfg: RunConfig, tokenizer: Any) -> list[PromptRecord]:
    """Every prompt of the run, train and validation (where a process that only generates, an engine rank,
    learns which tools each may call); none for single-turn runs, whose prompts call no tool."""
    if not cfg.rollout.multi_turn.enabled:
        return []
    val = val_datasets(cfg, tokenizer) if cfg.trainer.test_freq else {}
    return [*train_dataset(cfg, tokenizer).records, *(r for recs in val.values() for r in recs)]
