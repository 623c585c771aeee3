"""The CPU default at parallel.cp = 2 (2 ranks, TP = 1) trains as the default layout (TP = 2) does, its weight
sync's probe passes from each CP rank, and its checkpoint resumes at CP = 1 through the distributed checkpoint."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _runs import SHORT, metrics_rows, train_cmd

CP2 = ["parallel.tp=1", "parallel.cp=2", "trainer.save_freq=2"]
TP2 = ["parallel.tp=2", "parallel.cp=1", "trainer.save_freq=2"]


def _run(out: Path, steps: int, layout: list[str]) -> None:
    subprocess.run(train_cmd(out, steps, *SHORT, *layout), check=True, timeout=600)


@pytest.mark.slow
@pytest.mark.distributed
def test_cp2_run_trains_like_tp2_and_resumes_at_cp1(tmp_path):
    cp2, tp2 = tmp_path / "cp2", tmp_path / "tp2"
    _run(cp2, 2, CP2)
    _run(tp2, 2, TP2)
    a, b = metrics_rows(cp2), metrics_rows(tp2)
    assert sorted(a) == [1, 2]
    for step in (1, 2):
        # the same rollouts (the weights agree to fp32 rounding), the same loss and update
        assert a[step]["reward/mean"] == b[step]["reward/mean"], step
        for key in ("pacs/loss", "pacs/post_loss", "actor/grad_norm", "pacs/implicit_reward_abs_mean"):
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-3, abs=1e-6), (step, key)
        assert a[step]["actor/grad_norm"] > 0
    # the weight sync: each rank's engine (one per CP rank) scores as the actor does
    assert all(a[s]["sync/max_logprob_diff"] < 1e-4 and a[s]["rollout/logprob_diff_max"] < 1e-4 for s in a)
    assert (cp2 / "checkpoints" / "step_00000002" / "megatron").is_dir()
    _run(cp2, 3, TP2)  # CP = 2 -> 1 (and TP 1 -> 2): the distributed checkpoint reshards
    resumed = metrics_rows(cp2)
    assert sorted(resumed) == [1, 2, 3] and resumed[3]["actor/grad_norm"] > 0
