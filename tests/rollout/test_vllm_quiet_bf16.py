"""A bf16 start prints no per-tensor dtype line (issue 58, item 5): vLLM's "Attempted to load weight ... with
dtype torch.float32 into parameter with dtype torch.bfloat16", one per tensor when a bf16 engine reads the fp32
model dir the GGUF import writes (122 lines in the issue's SmolLM2 start), is on vllm_quiet's list.

A real bf16 SmolLM2 engine start takes minutes on this emulated-bf16 CPU (Zen 3, AVX2) beside the suite, so the
test drives vLLM's own code that writes the line (``AutoWeightsLoader``, vllm/model_executor/models/utils.py)
through vLLM's own logging config with the filter, and counts the third-party lines on the console: the
SmolLM2 shape's 30 layers x 2 norms + the final norm (61 tensors that take this path), none printed."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from pacs_megatron.rollout.vllm import quiet as vllm_quiet

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.subprocess,  # importing vLLM runs `file` on the interpreter
]


class _Norm(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, dtype=dtype), requires_grad=False)


class _Layer(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _Norm(dtype), _Norm(dtype)


class _Model(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, layers: int = 30) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(dtype) for _ in range(layers))
        self.norm = _Norm(dtype)


def _load(model: torch.nn.Module, dtype: torch.dtype) -> None:
    from vllm.model_executor.models.utils import AutoWeightsLoader

    AutoWeightsLoader(model).load_weights(
        (n, torch.full_like(p, 0.5, dtype=dtype)) for n, p in model.named_parameters()
    )


def test_a_bf16_start_prints_no_per_tensor_dtype_line(monkeypatch, capfd):
    monkeypatch.delenv(vllm_quiet.CONFIG_ENV, raising=False)
    monkeypatch.delenv(vllm_quiet.OURS_ENV, raising=False)
    vllm_quiet.quiet_vllm("WARNING")
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    vllm_root = logging.getLogger("vllm")
    saved = (list(vllm_root.handlers), vllm_root.level, vllm_root.propagate)
    try:
        configure_logging(LoggingConfig())  # what an engine start does, reading our file
        capfd.readouterr()
        _load(_Model(torch.bfloat16), torch.float32)  # bf16 engine, fp32 checkpoint: 61 tensors
        out = capfd.readouterr()
        console = [ln for ln in (out.out + out.err).splitlines() if ln.strip()]
        assert not [ln for ln in console if "Attempted to load weight" in ln], console[:3]
        # any other pair still prints: fp32 into fp16 is no rounding the actor shares
        _load(_Model(torch.float16, layers=1), torch.float32)
        out = capfd.readouterr()
        shown = [ln for ln in (out.out + out.err).splitlines() if "Attempted to load weight" in ln]
        assert len(shown) == 3 and "into parameter with dtype torch.float16" in shown[0]
    finally:
        vllm_root.handlers[:] = saved[0]
        vllm_root.setLevel(saved[1])
        vllm_root.propagate = saved[2]


def test_without_the_filter_the_same_start_prints_one_line_a_tensor(monkeypatch, capfd):
    """The count the issue saw, at INFO (no filter): the test above is no test of an empty path."""
    monkeypatch.delenv(vllm_quiet.CONFIG_ENV, raising=False)
    monkeypatch.delenv(vllm_quiet.OURS_ENV, raising=False)
    assert vllm_quiet.quiet_vllm("INFO") is None
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    vllm_root = logging.getLogger("vllm")
    saved = (list(vllm_root.handlers), vllm_root.level, vllm_root.propagate)
    try:
        configure_logging(LoggingConfig())
        capfd.readouterr()
        _load(_Model(torch.bfloat16), torch.float32)
        out = capfd.readouterr()
        assert sum("Attempted to load weight" in ln for ln in (out.out + out.err).splitlines()) == 61
    finally:
        vllm_root.handlers[:] = saved[0]
        vllm_root.setLevel(saved[1])
        vllm_root.propagate = saved[2]
