"""Checks that need the file system or an import, run by the launcher before any rank or model starts.

    pacs-megatron train --config c.yaml reward.fn=my_rewards:scroe
    [.. E pacs_megatron.launch.cli] config error: reward.fn='my_rewards:scroe': module 'my_rewards'
    has no attribute 'scroe'                                           (one line in the terminal)
    (exit 2; nothing was spawned, loaded or written)

At 7B scale a bad reward name or data path found inside the ranks costs minutes of model loading and
one traceback per rank; here it costs a second. What needs no file system (``rollout.n >= 2`` for
the RLOO / GRPO estimators, divisibility, choices) is already checked by the config dataclasses'
``__post_init__``; this module adds:

- ``reward.fn``: importable, callable, and its signature takes ``(prompt, response, ground_truth, extra)``;
- ``trainer.resume`` (``--resume``): a named checkpoint directory exists, and the checkpoint a resume
  would load (and ``model.tiny.*`` against an existing ``model.path/config.json``) has this model's
  shape (``utils/resume.py``);
- ``data.train_files`` (and ``data.val_files`` when ``trainer.test_freq`` > 0): each resolves to a file
  under the data root and its first row parses;
- ``rollout.engine=vllm``: ``data.max_prompt_length + rollout.max_response_length`` fits the model's
  ``max_position_embeddings`` (vLLM refuses a longer ``max_model_len`` with a pydantic error at start).

Every failure is a :class:`~pacs_megatron.config.ConfigError` naming the key and the fix, which the
launcher prints as one line and turns into exit code 2.
"""

from __future__ import annotations

from pathlib import Path

from pacs_megatron.config import ConfigError, RunConfig
from pacs_megatron.utils.resume import preflight_resume


def preflight(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` for the first problem found (see the module docstring)."""
    check_reward(cfg)
    check_resume(cfg)
    preflight_resume(cfg)
    check_data(cfg)
    check_vllm_context(cfg)


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


def check_vllm_context(cfg: RunConfig) -> None:
    if cfg.rollout.engine != "vllm":
        return
    import json

    config_json = Path(cfg.model.path) / "config.json"
    if config_json.is_file():
        limit = json.loads(config_json.read_text()).get("max_position_embeddings")
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
