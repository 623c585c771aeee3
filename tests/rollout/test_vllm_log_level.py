"""vLLM's own logging is at WARNING unless asked (``rollout.vllm.log_level``, or ``VLLM_LOGGING_LEVEL`` already in
the environment): issue 42 counted 177 of a SmolLM2 run's 240 console lines as vLLM's INFO lines."""

from __future__ import annotations

import logging

import pytest

from pacs_megatron.config import ConfigError, RolloutConfig
from pacs_megatron.config.rollout import VLLMConfig
from pacs_megatron.rollout.vllm.engine import set_vllm_log_level


def test_the_setting_defaults_to_warning_and_is_checked():
    assert RolloutConfig().vllm.log_level == "WARNING"
    assert VLLMConfig(log_level="info").log_level == "INFO"
    with pytest.raises(ConfigError, match="rollout.vllm.log_level"):
        VLLMConfig(log_level="LOUD")


def test_the_level_is_set_before_import_unless_the_environment_names_one(monkeypatch):
    """Fails on the old code (no such function: vLLM logged at its INFO default)."""
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "level", vllm_logger.level)  # restored after the test
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert set_vllm_log_level("WARNING") == "WARNING"
    import os

    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING" and vllm_logger.level == logging.WARNING
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")  # the user's own choice wins
    assert set_vllm_log_level("WARNING") == "DEBUG" and vllm_logger.level == logging.DEBUG
