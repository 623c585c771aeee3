"""The adapter-only weight sync end to end: the CPU default (2 ranks, TP=2 actor over gloo, one vLLM-on-CPU
engine per rank) with LoRA and PACS v2 (a reset every 2 steps merges the adapters into the base), trained
3 steps with ``sync.lora=adapter`` and with ``sync.lora=merged``.

Adapter run: every step's probe (engine through its adapter vs actor) passes the float32 bound; the base is
sent at the start and after the reset of step 2 only (``sync/base_sent`` 0, 1, 0), bitwise-checked then; the
other syncs carry the adapter alone, a tenth of the merged sync's bytes or less.
Both runs: the same seeds sample the same responses (the two engines' policies agree to float rounding), so
every loss, reward and gradient is the same and the engines' log-probs of the sampled tokens agree with the
actor's, and hence with each other, within the probe's bound."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _runs import NONDETERMINISTIC, SHORT, metrics_rows, train_cmd
from _vllm import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.distributed]

LORA_V2 = [
    "rollout.engine=vllm",
    "actor.lora.rank=8",
    "actor.lora.alpha=16",
    "algorithm.pacs.anchor=reference",
    "algorithm.reference_reset_every=2",
    "algorithm.mini_batch_size=5",  # two optimizer steps a step: the adapters move within a step
]
ENGINE_GAP = ("rollout/",)
"""Metrics of the engine's log-probs against the actor's (ratios, KL, differences): float rounding apart."""


def _run(out: Path, sync: str) -> dict[int, dict]:
    cmd = train_cmd(out, 3, *SHORT, *LORA_V2, f"sync.lora={sync}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return metrics_rows(out)


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    out = tmp_path_factory.mktemp("adapter") / "run"
    return out, _run(out, "adapter")


def test_adapter_sync_trains_with_the_probe_through_the_adapter(adapter_run):
    _, rows = adapter_run
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["reference/reset"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert [rows[s]["sync/base_sent"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]  # the reset changed the base
    for s, r in rows.items():
        assert r["sync/max_logprob_diff"] <= 1e-5 and r["sync/greedy_logprob_diff"] <= 1e-5, s
        assert r["rollout/logprob_diff_max"] <= 1e-5, s  # what the engine sampled with: actor's policy
    base_bytes = rows[2]["sync/gbytes"] - rows[2]["sync/adapter_gbytes"]
    assert rows[2]["sync/bitwise_tensors"] > 0 and rows[1]["sync/bitwise_tensors"] == 0
    assert rows[1]["sync/gbytes"] == rows[1]["sync/adapter_gbytes"] < base_bytes / 10


def test_adapter_sync_samples_and_trains_as_the_merged_sync(adapter_run, tmp_path):
    out, adapter = adapter_run
    merged = _run(tmp_path / "merged", "merged")
    assert sorted(merged) == sorted(adapter)
    same = NONDETERMINISTIC + ("sync/",) + ENGINE_GAP
    for s in adapter:
        maths = {k: v for k, v in adapter[s].items() if not k.startswith(same)}
        assert maths == {k: v for k, v in merged[s].items() if not k.startswith(same)}, s
        for key in ("rollout/logprob_diff_max", "sync/max_logprob_diff"):  # each engine within the bound
            assert merged[s][key] <= 1e-5 and adapter[s][key] <= 1e-5, (s, key)
        # the engines' log-probs of the same tokens: both within 1e-5 of the same actor's, so of each other
        gap = abs(adapter[s]["rollout/logprob_diff_mean"] - merged[s]["rollout/logprob_diff_mean"])
        assert gap <= 1e-6, s
    assert (out / "rollouts.jsonl").read_text() == (tmp_path / "merged" / "rollouts.jsonl").read_text()
