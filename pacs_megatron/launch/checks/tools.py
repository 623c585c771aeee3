"""Preflight of tool-integrated rollouts (``rollout.multi_turn``): the sandbox starts on this machine, every
tool in ``tools.enabled`` loads, and the chat template renders a tool turn; one line each, before any rank."""

from __future__ import annotations

from pathlib import Path

from pacs_megatron.config import ConfigError, RunConfig


def check_tools(cfg: RunConfig) -> None:
    """Nothing for single-turn runs; otherwise the three checks of the module docstring."""
    if not cfg.rollout.multi_turn.enabled:
        return
    from pacs_megatron.envs.registry import Toolbox, ToolError
    from pacs_megatron.envs.sandbox import SandboxError

    try:
        Toolbox(cfg.tools)  # loads every tool, then builds the sandbox, which checks its level (check_sandbox)
    except (SandboxError, ToolError) as e:
        raise ConfigError(str(e)) from None
    check_tool_turn(cfg)


def check_tool_turn(cfg: RunConfig) -> None:
    """The run's chat template renders a ``tool`` message after an assistant turn (rollout/multi_turn.py
    ToolTurn); skipped while the tokenizer is still to be written (model.init=tiny / gguf)."""
    from pacs_megatron.rollout.multi_turn import ToolTurn, uses_chat_template

    tok_dir = Path(cfg.model.tokenizer or cfg.model.path)
    if not uses_chat_template(cfg.data) or not (tok_dir / "tokenizer_config.json").is_file():
        return
    from pacs_megatron.data import load_tokenizer

    try:
        ToolTurn.split_template(load_tokenizer(tok_dir, cfg.data.chat_template))
    except ValueError as e:
        raise ConfigError(
            f"rollout.multi_turn.max_turns={cfg.rollout.multi_turn.max_turns} with data.chat_template="
            f"{cfg.data.chat_template} ({tok_dir}): {e}; choose a template that renders role 'tool' "
            "(data.chat_template=qwen2.5), or data.chat_template=none for raw <tool_response> text"
        ) from None
