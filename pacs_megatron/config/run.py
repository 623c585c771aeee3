"""The whole run's config, cross-area checks, and loading from YAML + overrides."""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pacs_megatron.config.actor import ActorConfig
from pacs_megatron.config.base import ConfigError
from pacs_megatron.config.critic import CriticConfig, critic_enabled
from pacs_megatron.config.data import DataConfig, RewardConfig
from pacs_megatron.config.launcher import LauncherConfig
from pacs_megatron.config.model import ModelConfig, ParallelConfig, check_context_parallel
from pacs_megatron.config.multi_turn import check_multi_turn
from pacs_megatron.config.rollout import RolloutConfig, SyncConfig, check_lora_sync
from pacs_megatron.config.switches import check_run_switches
from pacs_megatron.config.tools import ToolsConfig
from pacs_megatron.config.training import AlgorithmConfig, LoggingConfig, OptimizerConfig, TrainerConfig
from pacs_megatron.config.warmup import check_warmup_stop
from pacs_megatron.pacs.registry import losses_where


@dataclass
class RunConfig:
    """Everything one run needs. Cross-area checks live here; those that need the device or an import
    (quantized rollouts, routing replay) are launch/checks/device.py's, run by the preflight."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="outputs/model"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The learned critic (used when algorithm.policy.adv_estimator=gae)."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """The tools of tool-integrated rollouts (rollout.multi_turn) and their sandbox."""

    def __post_init__(self) -> None:
        n, algo, dp = self.rollout.n, self.algorithm, self.parallel.dp
        estimator = getattr(algo.loss_config(), "adv_estimator", "")  # "": a loss that reads no section
        if n < 2 and estimator in ("rloo", "grpo"):  # first: the batch-size fixes below depend on n
            key = f"algorithm.{algo.traits.section}.adv_estimator"
            raise ConfigError(
                f"rollout.n={n} with {key}={estimator} (algorithm.loss={algo.loss}): the estimator compares the "
                "responses of a prompt group, so use rollout.n >= 2 (the paper: 8)"
            )
        if self.actor.lora.enabled and self.parallel.sequence_parallel:
            raise ConfigError(
                "actor.lora.rank > 0 with parallel.sequence_parallel=true: LoRA does not support sequence "
                "parallelism yet (docs/lora.md); turn one of them off"
            )
        check_lora_sync(self.sync, self.rollout, self.actor.lora.rank)  # sync.lora=adapter: vLLM, LoRA
        check_context_parallel(self.parallel, critic_enabled(self), self.actor.routing_replay)  # CP: no critic yet
        check_multi_turn(
            self.rollout.multi_turn,
            self.tools.enabled,
            self.actor.routing_replay,
            self.rollout.placement,
            self.trainer.sft_warmup_steps,
        )
        check_warmup_stop(self.trainer.sft_warmup_stop, self.trainer.sft_warmup_steps, self.rollout.multi_turn.enabled)
        mini = self.mini_batch_prompts
        if self.trainer.train_batch_size % mini:
            raise ConfigError(
                f"algorithm.mini_batch_size={mini} must divide trainer.train_batch_size={self.trainer.train_batch_size}"
            )
        if mini % dp:
            raise ConfigError(f"algorithm.mini_batch_size={mini} prompts must split evenly over parallel.dp={dp} ranks")
        rows_per_rank = mini // dp * n
        for key, mbs, whole in (
            ("algorithm.micro_batch_size", algo.micro_batch_size, True),
            ("algorithm.logprob_micro_batch_size", algo.logprob_micro_batch_size, True),
            ("critic.micro_batch_size", self.critic.micro_batch_size, False),
        ):
            if mbs and (mbs % n or (whole and rows_per_rank % mbs)):  # one wording, one valid fix, for all three
                raise ConfigError(
                    f"{key}={mbs} sequences: a micro-batch holds whole prompt groups (a multiple of {n} = rollout.n)"
                    f" and divides the {rows_per_rank} sequences each DP rank holds per mini-batch (mini_batch_size"
                    f"/dp*n): set {key}={fitting_micro_batch(mbs, n, rows_per_rank)}"
                )
        if algo.dynamic_batching and algo.max_tokens_per_micro_batch:
            longest = -(-(self.data.max_prompt_length + self.rollout.max_response_length) // 8) * 8
            if n * longest > algo.max_tokens_per_micro_batch:
                raise ConfigError(
                    f"algorithm.max_tokens_per_micro_batch={algo.max_tokens_per_micro_batch} is below one prompt "
                    f"group at full length: {n} x {longest} (data.max_prompt_length + rollout.max_response_length, "
                    f"rounded to 8) = {n * longest} tokens; raise the budget to at least {n * longest}"
                )
        if self.model.init == "tiny":
            tiny = self.model.tiny
            for k in ("num_attention_heads", "num_key_value_heads"):
                if getattr(tiny, k) % self.parallel.tp:
                    raise ConfigError(
                        f"model.tiny.{k}={getattr(tiny, k)} must be divisible by parallel.tp={self.parallel.tp}"
                    )
            if tiny.num_layers % (self.parallel.pp * self.parallel.vpp):
                raise ConfigError("model.tiny.num_layers must be divisible by parallel.pp * parallel.vpp")
        if algo.policy.adv_estimator == "gae" and not algo.traits.gae:
            raise ConfigError(
                f"algorithm.policy.adv_estimator=gae is for loss {losses_where(lambda t: t.gae)} (algorithm.loss="
                f"{algo.loss} trains no critic): set algorithm.loss=ppo"
            )
        check_run_switches(self)  # dynamic sampling, overlong shaping, KL / entropy (config/switches.py)
        if self.data.task == "arith" and self.data.arith.style == "raw" and self.reward.fn in ("math", "math_boxed"):
            raise ConfigError(
                f"data.task=arith is scored by reward.fn=arith (exact match), not {self.reward.fn!r} "
                "(data.arith.style=words asks in words, scored by math_boxed or math)"
            )
        if self.data.task == "arith" and self.data.arith.style == "words" and self.reward.fn == "arith":
            raise ConfigError(
                "data.arith.style=words asks for the answer in \\boxed{}: score it with reward.fn=math_boxed (or "
                "math), not the exact match 'arith'"
            )
        truncated = [f for f, on in (("top_k", self.rollout.top_k > 0), ("top_p", self.rollout.top_p < 1)) if on]
        if algo.rollout_correction != "none" and truncated:
            # the engines report log-probs of the top-k/top-p renormalised distribution they sample from
            # (rollout/hf_engine.py sampling_logits; vLLM processed_logprobs), the actor the full one
            raise ConfigError(
                f"algorithm.rollout_correction={algo.rollout_correction} with rollout.{truncated[0]}="
                f"{getattr(self.rollout, truncated[0])}: the engine samples a top-k/top-p truncated distribution the "
                "actor does not score, so the weights would correct the truncation, not the engine mismatch: set "
                "rollout.top_k=-1 and rollout.top_p=1, or algorithm.rollout_correction=none"
            )

    @property
    def mini_batch_prompts(self) -> int:
        return self.algorithm.mini_batch_size or self.trainer.train_batch_size


def fitting_micro_batch(mbs: int, n: int, rows: int) -> int:
    """The micro-batch size (sequences) nearest ``mbs`` from below that holds whole groups of ``n`` and
    divides ``rows``: the fix a batch-size error offers, valid as it stands.

    Example:
        >>> fitting_micro_batch(80, 16, 160), fitting_micro_batch(80, 1, 10), fitting_micro_batch(7, 4, 40)
        (80, 10, 4)
    """
    fits = [m for m in range(n, rows + 1, n) if rows % m == 0]
    return max((m for m in fits if m <= mbs), default=fits[0])


def _format_omegaconf_error(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    if key and _field_kind(str(key)) == "list":
        msg += f" ({key} is a list: write {key}=[a,b], or {key}=a for one item)"
    return f"config key {key!r}: {msg}" if key else msg


def _yaml_chain(path: Path, depth: int = 0, named_by: Path | None = None) -> list:
    """The YAML file and the files it names under ``base:`` (relative to it), base first."""
    if not path.is_file():
        what = "is a directory, not a YAML file" if path.is_dir() else "does not exist"
        where = f" (named by 'base:' in {named_by})" if named_by is not None else ""
        raise ConfigError(f"config file {str(path)!r}{where} {what}")
    if depth > 8:
        raise ConfigError(f"config file {str(path)!r}: 'base:' chain deeper than 8 (a cycle?)")
    try:
        layer = OmegaConf.load(path)
    except yaml.YAMLError as e:  # one line naming the place, not the parser's traceback
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {where}: YAML syntax error: {problem}") from None
    base = layer.pop("base", None)
    if base is None:
        return [layer]
    return _yaml_chain(path.parent / str(base), depth + 1, named_by=path) + [layer]


def _field_kind(key: str) -> str:
    """ "list", "str" or "other": the type of the RunConfig field a dotted ``key`` names."""
    cls: Any = RunConfig
    hint: Any = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return "other"
        hint = typing.get_type_hints(cls).get(part)
        if hint is None:
            return "other"
        cls = hint
    if hint is str:
        return "str"
    return "list" if typing.get_origin(hint) is list else "other"


def _apply_overrides(merged: Any, overrides: list[str]) -> Any:
    """Merge ``a.b.c=value`` overrides in order. A list field takes a bare value as a one-item list
    (``data.train_files=my.jsonl``; ``a,b`` is two items, as is ``[a,b]``); a string field takes the text
    as written (``trainer.resume=yes`` stays "yes", not YAML's True), except ``null`` or ``~``, which clear
    it as an empty value does (``model.gguf=null``).

    ``model.init`` set here to anything but "gguf", with no ``model.gguf`` here, drops the file's
    ``model.gguf`` (a recipe's GGUF default, read only with init=gguf): ``model.init=pretrained
    model.path=DIR`` trains DIR on any recipe, as the README writes it."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like a.b.c=value, got {bad}")
    keys = set()
    for item in overrides:
        key, value = (x.strip() for x in item.split("=", 1))
        keys.add(key)
        kind = _field_kind(key)
        if kind == "str" and value in ("null", "~"):
            value = ""
        if kind == "str" and "${" not in value and not value.startswith(("'", '"')):
            OmegaConf.update(merged, key, value, merge=True)
            continue
        if kind == "list" and not value.startswith("["):
            item = f"{key}=[{value}]"
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
    if "model.init" in keys and "model.gguf" not in keys and merged.model.init != "gguf":
        OmegaConf.update(merged, "model.gguf", "", merge=True)
    return merged


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults <- YAML file (after the file its ``base:`` key names, if any) <- ``a.b.c=value``
    overrides, validated into a :class:`RunConfig`."""
    try:
        merged = OmegaConf.structured(RunConfig)
        if path is not None:
            for layer in _yaml_chain(Path(path)):
                merged = OmegaConf.merge(merged, layer)
        if overrides:
            merged = _apply_overrides(merged, list(overrides))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_format_omegaconf_error(e)) from None
    except ValueError as e:
        # The algorithm's own dataclasses name themselves; name the config key instead.
        msg = (
            str(e)
            .replace("PACSConfig.", "algorithm.pacs.")
            .replace("PolicyLossConfig.", "algorithm.policy.")
            .replace("GSPOConfig.", "algorithm.gspo.")
        )
        raise ConfigError(msg) from None


def to_yaml(cfg: RunConfig) -> str:
    """The resolved configuration as YAML (saved beside every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from a plain dict (e.g. one saved in a checkpoint)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(d)))
