"""Checks that need the file system or an import, run by the launcher before any rank or model starts.

A bad reward name or data path found inside the ranks costs minutes of model loading and one traceback per
rank; here it costs a second. Each failure is a :class:`~pacs_megatron.config.ConfigError` naming the key and
the fix (one line, exit 2). What is checked, key by key: docs/launch.md, "Preflight".
"""

from __future__ import annotations

import os
from pathlib import Path

from pacs_megatron.config import ConfigError, RunConfig
from pacs_megatron.launch.checks.device import check_device
from pacs_megatron.launch.checks.tools import check_tools
from pacs_megatron.launch.optional_deps import check_optional_deps
from pacs_megatron.run.layout import RunLayout
from pacs_megatron.run.resume import preflight_resume


def preflight(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` for the first problem found (the list: docs/launch.md, "Preflight")."""
    check_device(cfg)
    check_optional_deps(cfg)
    check_model_paths(cfg)
    check_reward(cfg)
    check_resume(cfg)
    check_run_dir(cfg)
    preflight_resume(cfg)
    check_data(cfg)
    check_tools(cfg)
    check_vllm_context(cfg)
    check_engine_gpus(cfg)
    warn_unused(cfg)
    warn_uncorrected_staleness(cfg)
    note_pacs_one_update(cfg)


def check_reward(cfg: RunConfig) -> None:
    check_reward_fn("reward.fn", cfg.reward.fn)


def check_reward_fn(key: str, spec: str) -> None:
    """The reward ``spec`` loads and takes (prompt, response, ground_truth, extra); ConfigError naming ``key``
    (``reward.fn`` for train, ``--reward`` for eval)."""
    from pacs_megatron.reward.registry import RewardFunctionError, load_reward_fn
    from pacs_megatron.utils.paths import named

    try:
        load_reward_fn(spec)
    except RewardFunctionError as e:
        raise ConfigError(str(e).replace(f"reward.fn={spec!r}", named(key, spec))) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise ConfigError(f"{named(key, spec)}: importing it raised {type(e).__name__}: {e}") from None


def check_resume(cfg: RunConfig) -> None:
    resume = cfg.trainer.resume
    if resume in ("auto", "never") or Path(resume).is_dir():
        return
    raise ConfigError(
        f"trainer.resume={resume!r} (--resume): no such checkpoint directory; give an existing "
        f"{RunLayout(Path(cfg.trainer.output_dir)).step_example}, or 'auto' / 'never'"
    )


def check_run_dir(cfg: RunConfig) -> None:
    """trainer.output_dir: no live lock, and no old run under a fresh start (the other ranks of a job skip
    it: by the time they look, their own rank 0 may hold the lock)."""
    from pacs_megatron.run.run_dir import RunDir
    from pacs_megatron.utils.paths import check_writable_dir

    if int(os.environ.get("RANK", "0")) != 0:
        return
    check_writable_dir("trainer.output_dir", cfg.trainer.output_dir)  # read-only, a file, under a file
    run_dir = RunDir.from_config(cfg)
    # a dry run takes no lock and writes nothing: it may look at a config beside the run that holds the lock
    problem = run_dir.fresh_problem() if cfg.trainer.dry_run else run_dir.problem()
    if problem:
        raise ConfigError(problem)
    check_checkpoint_space(cfg)


def checkpoint_bytes(cfg: RunConfig) -> int:
    """About how large one checkpoint of this run is: parameters x (their bytes + Adam's two fp32 moments
    + an fp32 master copy for bf16); 0 when the model's config cannot say (the check is then skipped)."""
    import json

    from pacs_megatron.launch.memory_plan import total_params

    config_json = Path(cfg.model.path) / "config.json"
    try:
        if config_json.is_file():
            hf = json.loads(config_json.read_text(encoding="utf-8"))
        elif cfg.model.init == "tiny":
            from pacs_megatron.data.synthetic import EOS_ID, PAD_ID, VOCAB, tiny_model_config

            hf = tiny_model_config(cfg.model.tiny, len(VOCAB), EOS_ID, PAD_ID)
        else:
            return 0
        params = total_params(hf)
    except (KeyError, TypeError, ValueError):
        return 0
    return params * (4 + 8 if cfg.model.dtype != "bfloat16" else 2 + 8 + 4)


def check_checkpoint_space(cfg: RunConfig) -> None:
    """trainer.output_dir's disk holds the next checkpoint (the last one's size, or before the first an
    estimate from the model: run/checkpoint.py), so a full disk is found at launch, not after training."""
    from pacs_megatron.run.checkpoint import CheckpointManager

    problem = CheckpointManager(cfg.trainer.output_dir, first_size=checkpoint_bytes(cfg)).space_problem()
    if problem:
        raise ConfigError(f"trainer.output_dir={cfg.trainer.output_dir!r}: {problem}")


def check_data(cfg: RunConfig) -> None:
    if cfg.data.task != "math":
        return
    from pacs_megatron.data.records import DataFormatError
    from pacs_megatron.data.sources import load_problems, resolve_dataset

    root = cfg.data.resolved_root()
    files = [("data.train_files", f) for f in cfg.data.train_files]
    if cfg.trainer.test_freq:
        files += [("data.val_files", f) for f in cfg.data.val_files]
    for key, name in files:
        try:
            _, path = resolve_dataset(name, root)
            load_problems(path, cfg.data.bad_records)  # every row, as the ranks will read it (~0.1 s per 10k)
        except (FileNotFoundError, DataFormatError) as e:
            raise ConfigError(f"{key} has {name!r}: {e}") from None


def check_model_paths(cfg: RunConfig) -> None:
    """model.path, model.tokenizer, critic.init: launch/model_dir.py's one check, before any rank loads them.

    ``init=pretrained`` needs readable weights that agree with config.json; ``init=random`` the config
    only; ``init=tiny`` nothing until the run has written its model directory."""
    from pacs_megatron.config.critic import critic_enabled
    from pacs_megatron.launch.model_dir import check_model_dir, check_tokenizer

    m = cfg.model
    to_write = m.written_by_run and not (Path(m.path) / "config.json").is_file()
    if m.init == "gguf":
        check_gguf(cfg, to_write)
    if not to_write:
        check_model_dir("model.path", m.path, weights=m.loads_weights, tokenizer=False)
    if m.tokenizer or not to_write:
        key, tok = ("model.tokenizer", m.tokenizer) if m.tokenizer else ("model.path", m.path)
        check_tokenizer(key, tok)
    check_chat_template(cfg, to_write)
    if critic_enabled(cfg) and cfg.critic.init != "actor":
        check_model_dir("critic.init", cfg.critic.init, tokenizer=False)


def check_chat_template(cfg: RunConfig, to_write: bool) -> None:
    """Math prompts (data.task=math, arith in words): ``data.chat_template`` finds a template for this
    tokenizer (data/prompts.py), read from its files (or, for a GGUF still to import, from the file's
    metadata) without loading it."""
    import json

    from pacs_megatron.data.prompts import is_qwen_tokenizer, select_template

    m = cfg.model
    if not cfg.data.renders_prompts or cfg.data.chat_template == "none" or (to_write and m.init == "tiny"):
        return
    if to_write and not m.tokenizer:  # init=gguf: the tokenizer comes out of the file
        from pacs_megatron.hf.gguf_import import read_gguf_info

        info = read_gguf_info(m.gguf)
        own, qwen, where = info.has_chat_template, info.config.get("model_type") == "qwen2", f"model.gguf={m.gguf}"
    else:
        tok_dir = Path(m.tokenizer or m.path)
        config_path = tok_dir / "tokenizer_config.json"
        tok_cfg = json.loads(config_path.read_text()) if config_path.is_file() else {}
        own = (tok_dir / "chat_template.jinja").is_file() or bool(tok_cfg.get("chat_template"))
        qwen, where = is_qwen_tokenizer(tok_cfg.get("tokenizer_class")), f"the tokenizer in {tok_dir}"
    select_template(cfg.data.chat_template, "(its own)" if own else None, qwen, where)


def check_gguf(cfg: RunConfig, to_import: bool) -> None:
    """model.init=gguf: the file is a GGUF transformers reads (when it is still to be imported), or the
    existing model.path was imported from this same file (sha256 in its provenance record)."""
    from pacs_megatron.hf.gguf_import import GGUFImportError, check_imported, read_gguf_info

    try:
        if to_import:
            read_gguf_info(cfg.model.gguf)
            return
        problem = check_imported(cfg.model.path, cfg.model.gguf)
    except GGUFImportError as e:
        raise ConfigError(f"model.gguf={cfg.model.gguf!r}: {e}") from None
    if problem:
        raise ConfigError(problem)


def unused_critic_settings(cfg: RunConfig) -> list[str]:
    """``critic.*`` keys changed from their defaults while no learned critic is trained (they do nothing)."""
    from dataclasses import asdict

    from pacs_megatron.config.critic import CriticConfig, critic_enabled
    from pacs_megatron.run.resume import config_changes

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


def pacs_loss_is_ln2(cfg: RunConfig) -> bool:
    """PACS v1 (a loss anchored at pi_old, ``LossTraits.anchored``) with one optimizer update per rollout batch:
    the loss is taken at pi_theta = pi_old."""
    a = cfg.algorithm
    updates = cfg.trainer.train_batch_size // cfg.mini_batch_prompts * a.ppo_epochs
    return a.traits.anchored and a.traits.anchor(a.loss_config()) == "old" and updates == 1


def note_pacs_one_update(cfg: RunConfig) -> None:
    """One line at start saying why such a run's loss reads 0.6931 every step (a newcomer reads it as broken);
    the local launcher's ranks leave it to their parent, as :func:`warn_unused`."""
    from pacs_megatron.utils.logging import get_logger

    if pacs_loss_is_ln2(cfg) and os.environ.get("PACS_LAUNCHER_KIND") != "local":
        get_logger(__name__).info(
            "algorithm.loss=pacs with one update per step: the loss is taken at pi_theta = pi_old, where the implicit "
            "reward r and psi are 0, so it reads ln 2 = 0.6931 every step, as it should; its gradient (class-weighted "
            "REINFORCE) still trains: watch reward/mean and val/*. Several updates per step "
            "(algorithm.mini_batch_size) or algorithm.pacs.anchor=reference make psi non-zero"
        )


def check_vllm_context(cfg: RunConfig) -> None:
    """rollout.engine=vllm: the prompt + response budget fits the model's position limit (vLLM's max_model_len)."""
    if cfg.rollout.engine != "vllm":
        return
    if (Path(cfg.model.path) / "config.json").is_file():
        from pacs_megatron.launch.model_dir import read_hf_config

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
