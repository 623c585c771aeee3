"""End to end on CPU: the real launcher, 2 ranks (TP=2 over gloo), the tiny synthetic task.

One short run is killed with SIGKILL after its step-2 checkpoint and resumed; its metrics for the
later steps must equal those of the uninterrupted run bit for bit (timings excepted). The user
reward raises on some responses: the run must count the errors and go on. A SIGTERM makes every
rank checkpoint and exit with 143, also when every process of the job gets it.

The uninterrupted run is the SIGTERM's run: it trains steps 1-4 before the signal, and its first four steps
are those of a 4-step run (the lr is constant here, so ``trainer.total_steps`` changes no number of theirs;
the only difference, the final step's save, is a checkpoint either way with ``save_freq=2``). Issue 59: one
training launch less than a separate 4-step reference run (docs/testing.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from _runs import CONFIG, deterministic, metrics_rows, run_watched, train_cmd, wait_for

SMALL = [
    "trainer.train_batch_size=10",
    "rollout.n=4",
    "algorithm.micro_batch_size=20",
    # token-budget micro-batches of 3 groups of 4 rows x 8 tokens (the last one smaller), resumed exactly
    "algorithm.dynamic_batching=true",
    "algorithm.max_tokens_per_micro_batch=96",
    "trainer.sft_warmup_steps=2",
    "trainer.save_freq=2",
    "trainer.test_freq=2",
    "logging.progress_bar=false",
    "reward.fn=flaky_reward:score",
]


def _cmd(out: Path, steps: int, *extra: str) -> list[str]:
    return train_cmd(out, steps, *SMALL, *extra)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    return env


_rows = metrics_rows


@pytest.mark.slow
@pytest.mark.distributed
def test_train_resume_sigkill_and_sigterm(tmp_path):
    # The uninterrupted run, ended by SIGTERM to every process of the job at once, as `scancel` signals a whole
    # Slurm step (after its step-4 checkpoint, with the reward workers running): helpers ignore it, every rank
    # checkpoints the step it finished, exit code 143.
    full = tmp_path / "full"
    proc = subprocess.Popen(_cmd(full, 50), env=_env())
    wait_for(lambda: (full / "checkpoints" / "step_00000004" / "COMPLETE").is_file() and 4 in _rows(full), 300, proc)
    job = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    assert len(job) > 3  # launcher, 2 ranks and their helpers
    for pid in job:
        os.kill(pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    rows = _rows(full)
    last = max(rows)
    assert last >= 4 and (full / "checkpoints" / f"step_{last:08d}" / "COMPLETE").is_file()
    assert sorted(rows) == list(range(1, last + 1))
    for key in (
        "reward/mean",
        "reward/accuracy",
        "reward/errors",
        "data/mixed_group_frac",
        "response/length_mean",
        "response/length_max",
        "response/truncation_rate",
        "pacs/loss",
        "pacs/psi_mean",
        "pacs/implicit_reward_abs_mean",
        "actor/grad_norm",
        "actor/skipped_steps",
        "actor/entropy",
        "actor/lr",
        "timing/rollout_s",
        "timing/old_logprob_s",
        "timing/update_s",
        "timing/sync_s",
        "timing/step_s",
        "perf/tokens_per_s",
        "sync/max_logprob_diff",
        "sync/gbytes",
        "pacs/first_minibatch_max_logratio",
    ):
        assert key in rows[1], key
    assert "val/arith/pass@1" in rows[2] and "val/arith/pass@4" in rows[4] and "timing/eval_s" in rows[2]
    # batch-invariant log-probs: the first training forward reproduces the old log-probs exactly
    assert all(r["pacs/first_minibatch_max_logratio"] == 0.0 for r in rows.values())
    assert sum(r["reward/errors"] for r in rows.values()) > 0  # the broken reward was hit, the run went on
    assert (full / "checkpoints" / "step_00000004" / "COMPLETE").is_file()
    assert (full / "rollouts.jsonl").is_file() and any((full / "tb").iterdir())

    # A 4-step run of the same config, killed with SIGKILL once step 3 is logged (after the step-2 checkpoint),
    # then resumed: steps 3 and 4 as the uninterrupted run's.
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(killed, 4), env=_env(), start_new_session=True)
    try:
        wait_for(lambda: (killed / "metrics.jsonl").exists() and 3 in _rows(killed), 300, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (killed / "checkpoints" / "step_00000004").exists()
    again = run_watched(_cmd(killed, 4), killed, env=_env())  # fails after 300 s without progress, not in all
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = _rows(killed)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert deterministic(resumed[step]) == deterministic(rows[step]), step


def test_dry_run_and_config_errors(tmp_path, capsys):
    from pacs_megatron.cli import main

    out = tmp_path / "dry"
    assert main(["train", "--config", str(CONFIG), "--dry-run", f"trainer.output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert "world_size" in printed and "tp: 2" in printed
    assert not out.exists()  # nothing heavy happened
    assert main(["train", "--config", str(CONFIG), "algorithm.micro_batch_size=7"]) == 2
    assert main(["train", "--config", str(CONFIG), "parallel.tp=4"]) == 2
