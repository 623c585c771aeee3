"""``model.dtype=auto`` (issue 58, item 4): bf16 where the CPU has native bf16 or on a GPU, fp32 elsewhere; one
log line; the resolved value is what the saved config, the checkpoint and final.json hold; a resumed run keeps
the dtype it started with and says so; an explicit value keys a run (tools/compare/runs.py) as before."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pacs_megatron.config import load_config
from pacs_megatron.launch import dtype as dtype_mod
from pacs_megatron.launch.dtype import choose_dtype, cpu_bf16_flags, resolve_model_dtype
from pacs_megatron.run.run_record import DTYPE_REASON_ENV, RunRecord, format_summary

REPO = Path(__file__).resolve().parents[2]
ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
ZEN5 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SPR = "processor\t: 0\nflags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n"


@pytest.mark.parametrize(("cpuinfo", "flags"), [(ZEN3, []), (ZEN5, ["avx512_bf16"]), (SPR, ["amx_bf16"])])
def test_cpu_bf16_flags(tmp_path, cpuinfo, flags):
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    assert cpu_bf16_flags(tmp_path / "cpuinfo") == flags
    assert cpu_bf16_flags(tmp_path / "missing") == []  # not Linux: no native bf16 known


def test_choose_dtype_per_machine():
    assert choose_dtype("auto", False, []).dtype == "float32"
    assert "no native bf16" in choose_dtype("auto", False, []).reason
    assert choose_dtype("auto", False, ["avx512_bf16"]).dtype == "bfloat16"
    assert choose_dtype("auto", False, ["amx_bf16"]).reason == "auto: this CPU has native bf16 (amx_bf16)"
    assert choose_dtype("auto", True, []).dtype == "bfloat16"
    for explicit in ("float32", "bfloat16"):  # an explicit value is the user's, on any machine
        assert choose_dtype(explicit, True, ["avx512_bf16"]) == choose_dtype(explicit, False, [])
        assert choose_dtype(explicit, False, []).dtype == explicit


def test_a_resumed_auto_run_keeps_its_dtype_and_says_so():
    c = choose_dtype("auto", False, [], started_with="bfloat16", checkpoint="/r/checkpoints/step_10")
    assert c.dtype == "bfloat16"
    assert "kept from the run's start (checkpoint /r/checkpoints/step_10)" in c.reason
    assert "this machine alone would pick float32" in c.reason
    same = choose_dtype("auto", False, [], started_with="float32", checkpoint="ck")
    assert same.dtype == "float32" and "would pick" not in same.reason
    # a checkpoint of a run from before the resolution recorded "auto": this machine decides
    assert choose_dtype("auto", False, ["avx512_bf16"], started_with="auto").dtype == "bfloat16"


def _checkpoint(root: Path, dtype: str) -> Path:
    step = root / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (step / "extra_state.json").write_text(json.dumps({"step": 3, "config": {"model": {"dtype": dtype}}}))
    return step


def test_resolve_in_place_logged_once_and_recorded(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: [])  # a Zen 3
    monkeypatch.delenv(DTYPE_REASON_ENV, raising=False)
    cfg = load_config(None, ["model.path=/m", "parallel.backend=gloo", f"trainer.output_dir={tmp_path / 'run'}"])
    assert cfg.model.dtype == "auto"
    with caplog.at_level(logging.INFO, logger="pacs_megatron"):
        choice = resolve_model_dtype(cfg)
    assert cfg.model.dtype == "float32" == choice.dtype
    lines = [r.getMessage() for r in caplog.records if "model.dtype=" in r.getMessage()]
    assert lines == ["model.dtype=float32: auto: this CPU has no native bf16 (no avx512_bf16 / amx_bf16 flag): bf16 "
                     "would be emulated"]  # fmt: skip
    # the run's record: the launch config's header and final.json
    record = RunRecord(cfg, tmp_path / "run", True, None)
    record.write_launch()
    text = (tmp_path / "run" / "config.yaml").read_text()
    assert "# model.dtype=float32: auto: this CPU has no native bf16" in text and "dtype: float32" in text
    summary = record.finish(0, None)
    assert summary["model_dtype"] == {"dtype": "float32", "reason": choice.reason}
    assert json.loads((tmp_path / "run" / "final.json").read_text())["model_dtype"]["dtype"] == "float32"
    assert "  model dtype   float32 (auto: this CPU has no native bf16" in format_summary(summary)


def test_resolve_keeps_the_checkpoints_dtype_on_another_machine(tmp_path, monkeypatch):
    run = tmp_path / "run"
    ckpt = _checkpoint(run, "bfloat16")  # started on a Zen 5
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: [])  # resumed on a Zen 3
    base = ["model.path=/m", "parallel.backend=gloo", f"trainer.output_dir={run}"]
    cfg = load_config(None, [*base, f"trainer.resume={ckpt}"])
    choice = resolve_model_dtype(cfg, log=False)
    assert cfg.model.dtype == "bfloat16" and "would pick float32" in choice.reason
    fresh = load_config(None, [*base, "trainer.resume=never"])  # a fresh start decides for this machine
    assert resolve_model_dtype(fresh, log=False).dtype == "float32"
    explicit = load_config(None, [*base, f"trainer.resume={ckpt}", "model.dtype=float32"])
    assert resolve_model_dtype(explicit, log=False).reason == "set in the config"  # the user's change wins


def test_an_explicit_dtype_keys_a_run_as_before(monkeypatch):
    """tools/compare/runs.py keys runs by their non-default settings: resolving leaves an explicit dtype, so the
    issue-56 comparison (model.dtype=float32 given) keeps its keys; the SmolLM2 recipes now say auto."""
    from pacs_megatron.tools.compare.runs import config_key

    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    recipe = REPO / "examples" / "configs" / "cpu_smollm2.yaml"
    cfg = load_config(recipe, ["model.dtype=float32", "parallel.backend=gloo", "trainer.resume=never"])
    before = config_key(cfg)
    resolve_model_dtype(cfg, log=False)
    assert config_key(cfg) == before and cfg.model.dtype == "float32"
    for name in ("cpu_smollm2", "cpu_smollm2_pacs_v1", "cpu_smollm2_pacs_v2", "cpu_smollm2_tools"):
        assert load_config(REPO / "examples" / "configs" / f"{name}.yaml").model.dtype == "auto", name
