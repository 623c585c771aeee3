"""The CPU patches' start-up part: megatron-core imports without building torch.compile wrappers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pacs_megatron.parallel.cpu_patches import _torch_compile_deferred


def test_a_deferred_compile_compiles_at_the_first_call_only(monkeypatch):
    calls = []
    real = torch.compile

    def spy(model=None, **kwargs):
        calls.append(kwargs)
        return real(model, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)

    def double(x):
        return 2 * x

    with _torch_compile_deferred():
        plain = torch.compile(double, backend="eager")
        with_args = torch.compile(backend="eager")(double)  # the @torch.compile(...) decorator form
    assert torch.compile is spy and calls == []  # restored; nothing built while decorating
    assert plain.__name__ == "double"
    x = torch.arange(3.0)
    assert torch.equal(plain(x), 2 * x) and torch.equal(plain(x), 2 * x)
    assert calls == [{"backend": "eager"}]  # built once, at the first call
    assert torch.equal(with_args(x), 2 * x) and len(calls) == 2


@pytest.mark.subprocess
def test_megatron_imports_on_cpu_without_inductor():
    """Old code: megatron's ``jit_fuser = torch.compile`` decorations imported dynamo and inductor as the
    package loaded (~2-3 s of every CPU rank's start), though this project calls none of those kernels."""
    code = (
        "import sys, torch\n"
        "from pacs_megatron.parallel.cpu_patches import apply_cpu_patches\n"
        "real = torch.compile\n"
        "assert apply_cpu_patches()\n"
        "from megatron.core import jit\n"
        "print('megatron.core' in sys.modules, 'torch._inductor.compile_fx' in sys.modules,\n"
        "      torch.compile is real, jit.jit_fuser is real)\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "True", "False"]
