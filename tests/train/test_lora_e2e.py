"""LoRA end to end on the CPU default (2 ranks, TP=2 over gloo) with PACS v2: the reference is the base model
with the adapters off (actor/lora/reference.py: no copy, no ``reference/`` in a checkpoint), a reset every 2
steps merges the adapters into the base and restarts them; every step's weight sync sends the merged weights
and its probe checks them (the run fails on a mismatch). A run stopped after the reset of step 2 and resumed
logs steps 3-4 bit for bit as the uninterrupted run; the run's summary suggests the merged export."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from _runs import SHORT, deterministic, metrics_rows, train_cmd

LORA = [
    "actor.lora.rank=8",
    "actor.lora.alpha=16",
    "algorithm.pacs.anchor=reference",
    "algorithm.reference_reset_every=2",
    "algorithm.mini_batch_size=5",  # two mini-batches a step: psi moves within a step
    "trainer.save_freq=2",
]


def _run(out: Path, steps: int) -> None:
    subprocess.run(train_cmd(out, steps, *SHORT, *LORA), check=True, timeout=600)


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_v2_trains_resets_and_resumes_exactly(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    _run(full, 4)
    rows = metrics_rows(full)
    assert sorted(rows) == [1, 2, 3, 4]
    assert [rows[s]["reference/reset"] for s in range(1, 5)] == [0.0, 1.0, 0.0, 1.0]
    assert all(rows[s]["pacs/post_psi_abs_mean"] > 0 and rows[s]["actor/grad_norm"] > 0 for s in rows)
    step2 = full / "checkpoints" / "step_00000002"
    assert (step2 / "megatron").is_dir() and not (step2 / "reference").exists()  # the base is the reference
    summary = json.loads((full / "final.json").read_text())
    assert summary["export_command"].endswith("--merge")

    _run(split, 2)
    _run(split, 4)
    resumed = metrics_rows(split)
    for step in range(1, 5):
        assert deterministic(resumed[step]) == deterministic(rows[step]), step
