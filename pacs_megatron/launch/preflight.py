"""Checks that need the file system or an import, run by the launcher before any rank or model starts.

    pacs-megatron train --config c.yaml reward.fn=my_rewards:scroe
    [.. E pacs_megatron.launch.cli] config error: reward.fn='my_rewards:scroe': module 'my_rewards'
    has no attribute 'scroe'                                           (one line in the terminal)
    (exit 2; nothing was spawned, loaded or written)

At 7B scale a bad reward name or data path found inside the ranks costs minutes of model loading and
one traceback per rank; here it costs a second. What needs no file system (``rollout.n >= 2`` for
the RLOO / GRPO estimators, divisibility, choices) is already checked by the config dataclasses'
``__post_init__``; this module adds:

- ``rollout.quantization`` / ``rollout.quant_recipe`` and ``actor.routing_replay``: runnable on this
  device with this install (modelopt importable, recipe runs on CPU, vLLM's FP8 scale layouts, routing
  replay only where vLLM can return routed experts): launch/device_checks.py;
- ``reward.fn``: importable, callable, and its signature takes ``(prompt, response, ground_truth, extra)``;
- ``trainer.resume`` (``--resume``): a named checkpoint directory exists, and the checkpoint a resume
  would load (and ``model.tiny.*`` against an existing ``model.path/config.json``) has this model's
  shape (``utils/resume.py``);
- ``trainer.output_dir``: not locked by a running run, and a fresh start does not land on an old run
  (``utils/run_dir.py``; checked by the launcher and rank 0 only, since rank 0 takes the lock);
- every model path: ``model.path`` holds a ``config.json`` that parses (and, for ``init=pretrained``,
  safetensors weights), ``model.tokenizer`` (or ``model.path``) holds a tokenizer, and ``critic.init``,
  when the learned critic is on and it names a directory, holds a config.json and weights too;
- ``data.train_files`` (and ``data.val_files`` when ``trainer.test_freq`` > 0): each resolves to a file
  under the data root and its first row parses;
- ``rollout.engine=vllm``: ``data.max_prompt_length + rollout.max_response_length`` fits the model's
  ``max_position_embeddings`` (vLLM refuses a longer ``max_model_len`` with a pydantic error at start);
- ``rollout.placement=separate`` on a GPU machine started by the local launcher: a GPU for every trainer
  rank and every engine (written for GPU, never run there).

Every failure is a :class:`~pacs_megatron.config.ConfigError` naming the key and the fix, which the
launcher prints as one line and turns into exit code 2.
"""

from __future__ import annotations

import os
from pathlib import Path

from pacs_megatron.config import ConfigError, RunConfig
from pacs_megatron.launch.device_checks import check_device
from pacs_megatron.utils.resume import preflight_resume


def preflight(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` for the first problem found (see the module docstring)."""
    check_device(cfg)
    check_model_paths(cfg)
    check_reward(cfg)
    check_resume(cfg)
    check_run_dir(cfg)
    preflight_resume(cfg)
    check_data(cfg)
    check_vllm_context(cfg)
    check_engine_gpus(cfg)
    warn_unused(cfg)
    warn_uncorrected_staleness(cfg)


def check_reward(cfg: RunConfig) -> None:
    from pacs_megatron.reward.registry import RewardFunctionError, load_reward_fn

    try:
        load_reward_fn(cfg.reward.fn)
    except RewardFunctionError as e:
        raise ConfigError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise ConfigError(f"reward.fn={cfg.reward.fn!r}: importing it raised {type(e).__name__}: {e}") from None


def check_resume(cfg: RunConfig) -> None:
    resume = cfg.trainer.resume
    if resume in ("auto", "never") or Path(resume).is_dir():
        return
    raise ConfigError(
        f"trainer.resume={resume!r} (--resume): no such checkpoint directory; give an existing "
        f"{Path(cfg.trainer.output_dir) / 'checkpoints'}/step_N, or 'auto' / 'never'"
    )


def check_run_dir(cfg: RunConfig) -> None:
    """trainer.output_dir: no live lock, and no old run under a fresh start (the other ranks of a job skip
    it: by the time they look, their own rank 0 may hold the lock)."""
    from pacs_megatron.utils.run_dir import RunDir

    if int(os.environ.get("RANK", "0")) != 0:
        return
    problem = RunDir.from_config(cfg).problem()
    if problem:
        raise ConfigError(problem)


def check_data(cfg: RunConfig) -> None:
    if cfg.data.task != "math":
        return
    from pacs_megatron.data.records import DataFormatError
    from pacs_megatron.data.sources import first_problem, resolve_dataset

    root = cfg.data.resolved_root()
    files = [("data.train_files", f) for f in cfg.data.train_files]
    if cfg.trainer.test_freq:
        files += [("data.val_files", f) for f in cfg.data.val_files]
    for key, name in files:
        try:
            _, path = resolve_dataset(name, root)
            first_problem(path)
        except (FileNotFoundError, DataFormatError) as e:
            raise ConfigError(f"{key} has {name!r}: {e}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any one of these makes a directory loadable by ``AutoTokenizer`` (fast, sentencepiece or BPE files)."""


def read_hf_config(key: str, directory: str | Path) -> dict:
    """``directory/config.json`` parsed, or ConfigError naming ``key`` and what is wrong."""
    import json

    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise ConfigError(f"{key}={str(directory)!r}: no such directory; point it at a Hugging Face model directory")
    if not path.is_file():
        raise ConfigError(f"{key}={str(directory)!r} has no config.json: point it at a Hugging Face model directory")
    try:
        hf = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}={str(directory)!r}: {path} is not valid JSON ({e})") from None
    if not isinstance(hf, dict) or "model_type" not in hf:
        raise ConfigError(f"{key}={str(directory)!r}: {path} has no model_type: not a Hugging Face model config")
    return hf


def _check_weights(key: str, directory: str | Path) -> None:
    d = Path(directory)
    if not (any(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").is_file()):
        raise ConfigError(
            f"{key}={str(directory)!r} holds no *.safetensors weights: download the model's weights there "
            "(model.init=random trains from a random initialisation instead)"
        )


def check_model_paths(cfg: RunConfig) -> None:
    """model.path (config.json parsed, weights), model.tokenizer, critic.init: before any rank loads them."""
    from pacs_megatron.config.critic import critic_enabled

    m = cfg.model
    tiny_to_write = m.init == "tiny" and not (Path(m.path) / "config.json").is_file()
    if not tiny_to_write:
        read_hf_config("model.path", m.path)
        if m.init == "pretrained":
            _check_weights("model.path", m.path)
    if m.tokenizer or not tiny_to_write:
        key, tok = ("model.tokenizer", m.tokenizer) if m.tokenizer else ("model.path", m.path)
        if not Path(tok).is_dir():
            raise ConfigError(f"{key}={tok!r}: no such tokenizer directory")
        if not any((Path(tok) / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(
                f"{key}={tok!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): set model.tokenizer "
                "to the model's tokenizer directory"
            )
    if critic_enabled(cfg) and cfg.critic.init != "actor":
        read_hf_config("critic.init", cfg.critic.init)
        _check_weights("critic.init", cfg.critic.init)


def unused_critic_settings(cfg: RunConfig) -> list[str]:
    """``critic.*`` keys changed from their defaults while no learned critic is trained (they do nothing)."""
    from dataclasses import asdict

    from pacs_megatron.config.critic import CriticConfig, critic_enabled
    from pacs_megatron.utils.resume import config_changes

    if critic_enabled(cfg):
        return []
    return [f"critic.{c}" for c in config_changes(asdict(CriticConfig()), asdict(cfg.critic))]


def warn_unused(cfg: RunConfig) -> None:
    """One warning for settings this run ignores (the local launcher's ranks leave it to their parent)."""
    from pacs_megatron.utils.logging import get_logger

    unused = unused_critic_settings(cfg)
    if unused and os.environ.get("PACS_LAUNCHER_KIND") != "local":
        get_logger(__name__).warning(
            "ignored: %s (algorithm.loss=%s trains no critic; the learned critic is used by loss=ppo/grpo with "
            "algorithm.policy.adv_estimator=gae)",
            ", ".join(unused),
            cfg.algorithm.loss,
        )


def check_vllm_context(cfg: RunConfig) -> None:
    """rollout.engine=vllm: the prompt + response budget fits the model's position limit (vLLM's max_model_len)."""
    if cfg.rollout.engine != "vllm":
        return
    if (Path(cfg.model.path) / "config.json").is_file():
        limit = read_hf_config("model.path", cfg.model.path).get("max_position_embeddings")
    elif cfg.model.init == "tiny":
        limit = cfg.model.tiny.max_position_embeddings
    else:
        return  # no model to read yet: the weights check reports that
    need = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if limit is not None and need > limit:
        raise ConfigError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_response_length "
            f"({cfg.rollout.max_response_length}) = {need} exceeds the model's max_position_embeddings ({limit}), "
            "which vLLM refuses as max_model_len (rollout.engine=vllm): lower one of the two"
        )


def check_engine_gpus(cfg: RunConfig) -> None:
    """rollout.placement=separate, local launch on GPUs: the engines take the GPUs after the trainer ranks'
    (launch/local.py), so the machine needs world_size + rollout.engines of them. Written for GPU, never run."""
    from pacs_megatron.utils.dist import under_launcher

    if cfg.rollout.placement != "separate" or cfg.launcher.kind == "ray" or under_launcher():
        return
    import torch

    if not torch.cuda.is_available():
        return
    need, have = cfg.parallel.world_size + cfg.rollout.engines, torch.cuda.device_count()
    if have < need:
        raise ConfigError(
            f"rollout.placement=separate needs a GPU per trainer rank and per engine: parallel.world_size="
            f"{cfg.parallel.world_size} + rollout.engines={cfg.rollout.engines} = {need}, this machine has {have}: "
            "lower one of them, or use launcher.kind=ray on a cluster"
        )


def warn_uncorrected_staleness(cfg: RunConfig) -> None:
    """rollout.max_staleness > 0 without importance weights: stale samples are used as if drawn from the
    proximal policy (on the CPU default k = 1 then degraded to reward 0.48 at step 200, 1.00 with tis:
    docs/benchmarks.md). A warning, not an error: a recipe that moves little per step may not need them."""
    from pacs_megatron.utils.logging import get_logger

    if cfg.rollout.max_staleness and cfg.algorithm.rollout_correction == "none":
        if os.environ.get("PACS_LAUNCHER_KIND") != "local":  # once, by the launcher, not by every rank
            get_logger(__name__).warning(
                "rollout.max_staleness=%d with algorithm.rollout_correction=none: samples up to %d policy versions "
                "old are trained on as if drawn from the current one; algorithm.rollout_correction=tis weights them "
                "(docs/async.md)",
                cfg.rollout.max_staleness,
                cfg.rollout.max_staleness,
            )
