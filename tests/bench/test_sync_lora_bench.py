"""``python -m pacs_megatron.bench.sync --lora-rank`` (bench/sync_lora.py) on the CPU default: the three syncs of a
LoRA actor into vLLM timed side by side on the config's 2 ranks, their bytes, and a verified adapter sync at
the end (the numbers of docs/benchmarks.md come from this command on the CPU default and SmolLM2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _runs import CONFIG
from _vllm import needs_vllm


@needs_vllm
@pytest.mark.slow
@pytest.mark.distributed
def test_lora_sync_bench_on_the_cpu_default(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pacs_megatron.bench.sync", "--lora-rank", "8", "--config", str(CONFIG)]
    proc = subprocess.run([*cmd, "--repeat", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["environment"]["command"].startswith("python -m pacs_megatron.bench.sync --lora-rank 8 --config")
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:
        sizes = r["bytes"]
        assert sizes["full"] == sizes["merged"] > 10 * sizes["adapter"] > 0  # 1.98 MB against 0.18 MB
        assert set(r["seconds"]) == {"full", "merged", "adapter"} and all(s > 0 for s in r["seconds"].values())
        assert set(r["adapter_parts_seconds"]) == {"gather", "write", "load"}
        assert r["probe_max_logprob_diff"] <= 1e-5  # the engine serves base + adapter as the actor computes
