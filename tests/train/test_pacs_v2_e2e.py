"""PACS v2 end to end on the CPU default (2 ranks, TP=2 over gloo): the implicit reward anchored on the
reference policy (algorithm.pacs.anchor=reference), hard-reset every 2 steps, the reference offloaded, with
truncated rows masked (they leave their group, pacs/loss.py). The classifier acts from the second step's
first mini-batch on; a reset is logged at steps 2 and 4; a run stopped right after the reset of step 2 and
resumed logs steps 3-5 (another reset inside) bit for bit as the uninterrupted run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _runs import SHORT, deterministic, metrics_rows, train_cmd

V2 = [
    "algorithm.pacs.anchor=reference",
    "algorithm.reference_reset_every=2",
    "actor.offload_reference=true",
    "algorithm.overlong.mask_truncated=true",
    "algorithm.mini_batch_size=5",  # two mini-batches a step: the second sees psi move under v1 too
    "trainer.save_freq=2",
]


def _run(out: Path, steps: int) -> None:
    subprocess.run(train_cmd(out, steps, *SHORT, *V2), check=True, timeout=600)


@pytest.mark.slow
@pytest.mark.distributed
def test_v2_resets_and_resumes_exactly_across_a_reset(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    _run(full, 5)
    rows = metrics_rows(full)
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert [rows[s]["reference/reset"] for s in range(1, 6)] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert [rows[s]["reference/age"] for s in range(1, 6)] == [0.0, 1.0, 0.0, 1.0, 0.0]  # the one each step used
    # step 1's first mini-batch is at the reference (psi = 0), its second is not; from step 2 on every
    # mini-batch is measured against a reference the policy has moved from
    assert rows[1]["pacs/psi_abs_mean"] > 0 and rows[1]["pacs/first_minibatch_max_logratio"] == 0.0
    assert all(rows[s]["pacs/post_psi_abs_mean"] > 0 for s in rows)
    assert all(0.0 <= rows[s]["pacs/brier"] <= 1.0 and "pacs/post_psi_p90" in rows[s] for s in rows)
    assert (full / "checkpoints" / "step_00000004" / "reference").is_dir()

    _run(split, 2)
    _run(split, 5)
    resumed = metrics_rows(split)
    for step in range(1, 6):
        assert deterministic(resumed[step]) == deterministic(rows[step]), step
