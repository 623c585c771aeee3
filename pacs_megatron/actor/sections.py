"""The config sections the policy and its critic are built from: a component takes the configs it reads.

    sections = ActorSections(model, parallel, actor, optimizer, TrainView.of(algorithm, rollout, data, trainer))
    actor = MegatronActor(sections, groups, model_dir)

The run config stops at the loop: ``loop/build.py`` assembles these from a ``RunConfig``; a tool that wants
an actor (tools/parity.py) builds them from its own flags and the sections' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from pacs_megatron.actor.optimizer import total_optimizer_steps
from pacs_megatron.batch.packing import token_budget
from pacs_megatron.config import (
    ActorConfig,
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RolloutConfig,
    TrainerConfig,
)


@dataclass(frozen=True)
class TrainView:
    """The run-wide values the actor's training reads beyond its own sections.

    Example:
        >>> from pacs_megatron.config import AlgorithmConfig, DataConfig, RolloutConfig, TrainerConfig
        >>> v = TrainView.of(AlgorithmConfig(), RolloutConfig(), DataConfig(), TrainerConfig())
        >>> v.algorithm.loss, v.optimizer_steps == TrainerConfig().total_steps
        ('pacs', True)
    """

    algorithm: AlgorithmConfig
    """The loss and its sections (any registered loss's, for ``train_step(loss_name=...)``), its KL / entropy
    terms, the micro-batch size, dynamic batching and its token budget, and whether a reference is built."""
    temperature: float
    """``rollout.temperature``: the sampling temperature the loss's log-probs are taken at."""
    max_prompt_length: int
    """``data.max_prompt_length``: with ``max_response_length``, the default token budget of a micro-batch."""
    max_response_length: int
    """``rollout.max_response_length``: the default horizon of the loss aggregation and of the token budget."""
    optimizer_steps: int
    """Optimizer updates of the whole run (:func:`total_optimizer_steps`): the lr schedule's length."""

    @property
    def micro_batch_tokens(self) -> int:
        """The most tokens a micro-batch holds: ``algorithm.max_tokens_per_micro_batch``, or a fixed micro-batch's
        rows at the longest prompt + response (batch/packing.py ``token_budget``)."""
        a = self.algorithm
        return token_budget(
            a.max_tokens_per_micro_batch, a.micro_batch_size, self.max_prompt_length + self.max_response_length
        )

    @classmethod
    def of(
        cls, algorithm: AlgorithmConfig, rollout: RolloutConfig, data: DataConfig, trainer: TrainerConfig
    ) -> TrainView:
        """The view of a run with these sections (``loop/build.py`` passes the run's)."""
        return cls(
            algorithm=algorithm,
            temperature=rollout.temperature,
            max_prompt_length=data.max_prompt_length,
            max_response_length=rollout.max_response_length,
            optimizer_steps=total_optimizer_steps(trainer, algorithm),
        )


@dataclass(frozen=True)
class ActorSections:
    """What a :class:`~pacs_megatron.actor.actor.MegatronActor` (and its critic) is built from and reads."""

    model: ModelConfig
    """The weights and their numerics: dtype, seed, init (loaded or drawn), activation recompute, the fused LM
    head, bf16 rounding of the update, the MoE load-balancing coefficient; the checkpoint's base."""
    parallel: ParallelConfig
    """Sequence parallelism and the context-parallel checks (the layout itself comes with the process groups)."""
    actor: ActorConfig
    """LoRA adapters, MoE routing replay, offloading during rollouts and of the reference."""
    optimizer: OptimizerConfig
    """Adam, gradient clipping, the lr schedule and the distributed optimizer's switch (the critic's:
    ``critic.optim``)."""
    train: TrainView
    """The loss, batching, temperature, lengths and schedule length (:class:`TrainView`)."""
