"""The recipe switches end to end on the CPU default (2 ranks, TP=2 over gloo), GRPO with dynamic sampling,
the KL reference (offloaded), the entropy bonus and truncated-response masking all on: every trained group
is mixed, the switches' metrics are logged, and a run stopped after step 2 and resumed logs step 3 bit for
bit as the uninterrupted run (the prompt stream and the reference policy come back from the checkpoint)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from _runs import SHORT, deterministic, metrics_rows, train_cmd

SWITCHES = [
    "algorithm.loss=grpo",
    "algorithm.filter_groups=mixed",
    "algorithm.max_gen_batches=4",
    "algorithm.gen_batch_size=10",  # later rounds draw 10 and give back what the step does not need
    "reward.fn=parity_reward:score",  # most groups mixed: the hash of the response text, not its truth
    "algorithm.kl_loss_coef=0.1",
    "algorithm.kl_loss_type=k3",
    "algorithm.entropy_coeff=0.01",
    "algorithm.overlong.mask_truncated=true",
    "actor.offload_reference=true",
    "trainer.save_freq=2",
]


def _run(out: Path, steps: int) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    subprocess.run(train_cmd(out, steps, *SHORT, *SWITCHES), env=env, check=True, timeout=600)


@pytest.mark.slow
@pytest.mark.distributed
def test_switches_train_and_resume_exactly(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    _run(full, 3)
    rows = metrics_rows(full)
    assert sorted(rows) == [1, 2, 3]
    for row in rows.values():
        assert row["data/mixed_group_frac"] == 1.0 and row["sampling/trained_groups"] == 10
        assert row["sampling/generated_groups"] >= row["sampling/kept_groups"] >= 10
        assert "overlong/masked_frac" in row and row["actor/entropy_loss"] > 0
    assert sum(r["sampling/returned_prompts"] for r in rows.values()) > 0  # a later round drew more than needed
    assert rows[1]["actor/kl_loss"] == 0.0  # the first mini-batch: the policy is the reference
    assert rows[3]["actor/kl_loss"] > 0
    assert (full / "checkpoints" / "step_00000003" / "reference").is_dir()

    _run(split, 2)
    _run(split, 3)
    resumed = metrics_rows(split)
    for step in (1, 2, 3):
        assert deterministic(resumed[step]) == deterministic(rows[step]), step
