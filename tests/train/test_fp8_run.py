"""FP8 rollouts end to end on CPU (the real launcher, 2 ranks, TP=2 over gloo, the HF engine), 3 steps each:

- ``rollout.quantization=fp8`` + ``algorithm.rollout_correction=tis``: the transfer probe (engine vs the
  actor holding the same quantize-dequantized weights) stays < 1e-4 while the quantization gap (engine
  vs the trained weights) is real, and the per-step mismatch and importance-weight metrics are logged;
- ``rollout.quantization=none`` on the CPU default batch: the engine's sampled-token log-probs equal the
  actor's old log-probs to < 1e-4 every step.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "cpu_tiny.yaml"
SHORT = ["trainer.total_steps=3", "trainer.sft_warmup_steps=2", "trainer.test_freq=0", "logging.progress_bar=false"]


def _run(out: Path, *overrides: str) -> dict[int, dict]:
    cmd = [sys.executable, "-m", "pacs_megatron", "train", "--config", str(CONFIG)]
    cmd += [f"trainer.output_dir={out}", f"model.path={out}/model", *SHORT, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows}


@pytest.mark.slow
@pytest.mark.distributed
def test_fp8_rollouts_probe_gap_and_mismatch(tmp_path):
    pytest.importorskip("modelopt.torch.quantization")
    rows = _run(
        tmp_path / "fp8",
        "trainer.train_batch_size=10",
        "rollout.n=4",
        "algorithm.micro_batch_size=20",
        "rollout.quantization=fp8",
        "algorithm.rollout_correction=tis",
    )
    assert sorted(rows) == [1, 2, 3]
    for step, r in rows.items():
        assert r["sync/max_logprob_diff"] < 1e-4, (step, r["sync/max_logprob_diff"])
        # FP8 E4M3 moves log-probs by ~1e-3..1e-2 on this model; fp32 transfer noise is ~1e-6.
        assert r["sync/quant_logprob_diff"] > 1e-4, (step, r["sync/quant_logprob_diff"])
        assert r["sync/quant_logprob_diff"] > 10 * r["sync/max_logprob_diff"]
        assert 1e-5 < r["rollout/logprob_diff_max"] < 1.0, (step, r["rollout/logprob_diff_max"])
        assert 0 < r["rollout/logprob_diff_mean"] <= r["rollout/logprob_diff_max"]
        assert r["rollout/k3_kl_seq"] >= 0 and math.isfinite(r["rollout/kl_seq"])
        assert 0.5 < r["rollout/is_weight_mean"] <= 2.0 and 0 <= r["rollout/is_clipped_frac"] <= 1


@pytest.mark.slow
@pytest.mark.distributed
def test_unquantized_rollouts_match_the_actor_every_step(tmp_path):
    rows = _run(tmp_path / "none")  # the CPU default batch: 50 prompts x n=16
    assert sorted(rows) == [1, 2, 3]
    for step, r in rows.items():
        assert r["rollout/logprob_diff_max"] < 1e-4, (step, r["rollout/logprob_diff_max"])
        assert r["sync/quant_logprob_diff"] == r["sync/max_logprob_diff"]
        assert "rollout/is_weight_mean" not in r  # no correction by default
