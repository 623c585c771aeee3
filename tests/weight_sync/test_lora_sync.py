"""The adapter-only weight sync (``sync.lora=adapter``; weight_sync/adapter.py, rollout/vllm/lora.py).

Fast: the config refuses what it cannot serve in one line naming the field and the fix; vLLM's rank slots;
the sync's extra metrics. Slow (an engine starts): a real LoRA MegatronActor beside a real vLLM-on-CPU engine
in one child process (tests/weight_sync/_lora_sync_rank.py): the first sync sends the base and the adapter,
the next ones the adapter alone, checked by the probe through the adapter; a wrong adapter (B scaled by 1.5)
fails the probe; a PACS v2 reset sends the base again and restarts the adapter ids; one adapter stays resident.
The e2e comparison with the merged sync is tests/train/test_lora_adapter_sync_e2e.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _vllm import needs_vllm

from pacs_megatron.config import ConfigError, load_config
from pacs_megatron.rollout.vllm.lora import lora_llm_kwargs, max_lora_rank
from pacs_megatron.weight_sync.adapter import AdapterSync, base_generation
from pacs_megatron.weight_sync.sync import SyncResult

RANK_SCRIPT = Path(__file__).with_name("_lora_sync_rank.py")
ADAPTER = ["actor.lora.rank=8", "rollout.engine=vllm", "sync.lora=adapter"]


def test_config_default_is_merged_and_adapter_needs_lora_and_vllm():
    assert load_config(None, ["actor.lora.rank=8"]).sync.lora == "merged"
    assert load_config(None, ADAPTER).sync.lora == "adapter"
    cases = {
        "actor.lora.rank=0": "sync.lora=adapter needs LoRA: set actor.lora.rank > 0",
        "rollout.engine=hf": "sync.lora=adapter needs rollout.engine=vllm",
        "rollout.placement=separate": "sync.lora=adapter needs rollout.placement=colocated",
        "rollout.quantization=fp8": "sync.lora=adapter with rollout.quantization=fp8",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message) as e:
            load_config(None, [*ADAPTER, override])
        assert "\n" not in str(e.value) and "sync.lora=merged" in str(e.value)  # one line, with the fix
    with pytest.raises(ConfigError, match="sync.lora='both' is not valid"):
        load_config(None, ["sync.lora=both"])


def test_vllm_lora_ranks():
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 512)] == [1, 8, 8, 16, 64, 512]
    with pytest.raises(ValueError, match="rank <= 512"):
        max_lora_rank(513)
    kwargs = lora_llm_kwargs(16, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    assert kwargs == {
        "enable_lora": True,
        "max_lora_rank": 16,
        "max_loras": 1,
        "max_cpu_loras": 1,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }


def test_adapter_metrics_only_with_the_adapter_sync():
    merged = SyncResult(seconds=1.0, gbytes=2.0, max_logprob_diff=0.0, buckets=1).metrics()
    assert "sync/base_sent" not in merged and "sync/adapter_gbytes" not in merged
    adapter = SyncResult(1.0, 0.001, 0.0, 0, adapter_gbytes=0.001, base_sent=0.0).metrics()
    assert adapter["sync/base_sent"] == 0.0 and adapter["sync/adapter_gbytes"] == 0.001


def test_adapter_sync_refuses_an_engine_without_adapters_and_reads_the_reset_step():
    with pytest.raises(ValueError, match="serves no LoRA adapter"):
        AdapterSync(SimpleNamespace(), SimpleNamespace(update_weights=None), None)
    assert base_generation(SimpleNamespace(reference=None)) == 0
    assert base_generation(SimpleNamespace(reference=SimpleNamespace(reset_step=6))) == 6


@needs_vllm
@pytest.mark.slow
def test_adapter_sync_into_vllm_probe_broken_adapter_and_reset(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(RANK_SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    first, second, third = out["first"], out["second"], out["third"]
    # first sync: base (bitwise-checked through vLLM's LoRA wrappers) + adapter; then the adapter alone
    assert first["sync/base_sent"] == 1.0 and first["sync/bitwise_tensors"] == 26.0 and out["lora_request"] == 1
    assert second["sync/base_sent"] == 0.0 and second["sync/buckets"] == 0.0
    assert second["sync/gbytes"] == second["sync/adapter_gbytes"] < first["sync/gbytes"] / 5
    for r in (first, second, third):  # the probe through the adapter, the merged sync's float32 bound
        assert r["sync/max_logprob_diff"] <= 1e-5 and r["sync/greedy_logprob_diff"] <= 1e-5
    assert out["adapter_effect"] > 0.05  # the adapter changes the policy: the probe would see it missing
    assert out["broken"].startswith("after weight sync the engine's log-probs differ")  # B x 1.5 fails
    # one adapter resident, one directory on disk; after the reset the base again and ids from 1
    assert out["held"] == [2] and out["dirs"] == ["adapter_000002"]
    assert third["sync/base_sent"] == 1.0 and out["third_id"] == 1 and out["held_after_reset"] == [1]
    assert out["root_removed"]
