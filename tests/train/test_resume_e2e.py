"""Issue 13 end to end on the CPU default (2 ranks, TP=2 over gloo, tiny task), one run dir:

1. a fresh 3-step run: summary on rank 0 + final.json, configs/launch_000.yaml, ETA log lines; it
   validates at its last step although 3 is not a multiple of ``test_freq`` (issue 42);
2. its newest checkpoint truncated, then resumed with lr, loss, n and batch settings changed: the
   damaged one is moved aside with a warning and the previous one used; the diff is printed and
   recorded in launch_001.yaml; the new lr really applies; rollouts.jsonl / TensorBoard are trimmed;
   pruning keeps 2 valid checkpoints;
3. a launch refused (model.tiny disagrees with model.path) writes no launch record;
4. a re-run of the complete run says so, exits 0 and, with trainer.export_hf=true, exports; once the
   export is there, another re-run says so from the run directory, without spawning ranks (issue 42);
5. ``pacs-megatron export`` at TP=1 gives the same files, loadable by transformers and by eval;
6. ``--dry-run`` works beside a running run (it takes no lock); a real launch beside it is refused (issue 42).

(4)'s second re-run and (6) were tests/train/test_run_end.py's, which trained a 3-step run of its own for them
(issue 59: one launch of ranks less; docs/testing.md lists the merge).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "cpu_tiny.yaml"
SMALL = ["trainer.train_batch_size=10", "trainer.sft_warmup_steps=1", "trainer.save_freq=1", "trainer.test_freq=2"]
CHANGED = ["optimizer.lr=0.5", "algorithm.loss=grpo", "rollout.n=8", "algorithm.micro_batch_size=40"]


def _run(*argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "pacs_megatron", *argv],
        capture_output=True,
        text=True,
        timeout=400,
        env=dict(os.environ),
    )
    return proc


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return _run(
        "train", "--config", str(CONFIG), f"trainer.output_dir={out}", f"model.path={out}/model", *SMALL, *extra
    )


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _launches(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "configs").iterdir())


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_changed_damaged_complete_and_export(tmp_path):
    out = tmp_path / "run"
    a = _train(
        out, "trainer.total_steps=3", "trainer.keep_checkpoints=3", "rollout.n=4", "algorithm.micro_batch_size=20"
    )
    assert a.returncode == 0, a.stderr[-3000:]
    final = json.loads((out / "final.json").read_text())
    assert final["status"] == "complete" and final["last_step"] == 3 and final["launches"] == 1
    assert "val/arith/pass@1" in final["best_val"] and final["last_checkpoint"].endswith("step_00000003")
    assert "run complete: step 3/3" in a.stderr and "val           arith pass@1: best" in a.stderr
    assert "progress: step 3/3 (100%)" in a.stderr and "ETA" in a.stderr  # captured output: no terminal
    assert _launches(out) == ["launch_000.yaml"]
    validated = [r["step"] for r in _jsonl(out / "metrics.jsonl") if "val/arith/pass@1" in r]
    assert validated == [2, 3]  # fails on issue 42's old code: [2] (the last step was not a multiple of test_freq)

    # (2) the newest checkpoint is damaged; resume with changed settings
    shard = sorted((out / "checkpoints" / "step_00000003" / "megatron").glob("*.distcp"))[-1]
    with shard.open("r+b") as fh:
        fh.truncate(1000)
    b = _train(out, "trainer.total_steps=4", *CHANGED)
    assert b.returncode == 0, b.stderr[-3000:]
    assert f"shard megatron/{shard.name} is truncated" in b.stderr and "falling back" in b.stderr
    assert (out / "checkpoints" / "corrupt_step_00000003" / "megatron" / shard.name).is_file()
    assert "resuming from" in b.stderr and "optimizer.lr: 0.0003 -> 0.5" in b.stderr
    rows = {r["step"]: r for r in _jsonl(out / "metrics.jsonl")}
    assert sorted(rows) == [1, 2, 3, 4] and len(_jsonl(out / "metrics.jsonl")) == 4
    assert rows[2]["actor/lr"] == 0.0003 and rows[3]["actor/lr"] == 0.5 and rows[4]["actor/lr"] == 0.5
    assert "policy/loss" in rows[3] and "pacs/loss" not in rows[3]  # loss changed
    assert rows[3]["data/tokens"] > 1.5 * rows[2]["data/tokens"]  # n=8: twice the sequences
    assert set(Counter(r["step"] for r in _jsonl(out / "rollouts.jsonl")).values()) == {4}  # no step twice
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "corrupt_step_00000003",
        "step_00000003",
        "step_00000004",
    ]
    assert _launches(out) == ["launch_000.yaml", "launch_001.yaml"]
    record = (out / "configs" / "launch_001.yaml").read_text()
    assert "#   optimizer.lr: 0.0003 -> 0.5" in record and "#   rollout.n: 4 -> 8" in record
    assert (out / "config.yaml").read_text() == record
    assert json.loads((out / "final.json").read_text())["launches"] == 2

    # (3) a refused launch (one rank: no spawn) leaves the record alone
    bad = _train(out, "trainer.total_steps=5", "parallel.tp=1", "model.tiny.hidden_size=64", *CHANGED)
    assert bad.returncode != 0 and "model.tiny.hidden_size=64 but config.json has hidden_size=128" in bad.stderr
    assert _launches(out) == ["launch_000.yaml", "launch_001.yaml"]

    # (4) the run is complete: say so, export on request, exit 0
    c = _train(out, "trainer.total_steps=4", "trainer.export_hf=true", *CHANGED)
    assert c.returncode == 0, c.stderr[-3000:]
    assert "run already complete at step 4" in c.stderr
    assert json.loads((out / "final.json").read_text())["status"] == "complete"  # the run's own record stays
    hf = out / "checkpoints" / "step_00000004" / "hf"
    assert (hf / "model.safetensors").is_file() and (hf / "tokenizer.json").is_file()
    again = _train(out, "trainer.total_steps=4", "trainer.export_hf=true", *CHANGED)  # the export is there now
    assert again.returncode == 0, again.stderr[-3000:]
    assert "run already complete at step 4" in again.stderr
    assert "local ranks" not in again.stderr and "resuming from" not in again.stderr  # fails on issue 42's old code
    assert json.loads((out / "final.json").read_text())["status"] == "complete"

    # (5) export at another layout: the same tensors; transformers and eval load it
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    exported = tmp_path / "exported"
    e = _run("export", str(hf.parent), str(exported), "--tp", "1")
    assert e.returncode == 0, e.stderr[-3000:]
    mine, ref = load_file(exported / "model.safetensors"), load_file(hf / "model.safetensors")
    assert set(mine) == set(ref) and all(torch.equal(mine[k], ref[k]) for k in ref)
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert torch.isfinite(model(input_ids=torch.tensor([[2, 3, 4]])).logits).all()
    data = tmp_path / "arith.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{a}="}], "reward_model": {"ground_truth": str(2 * a)}}
        for a in range(3)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from pacs_megatron.cli import main

    argv = ["eval", "--model", str(exported), "--data", str(data), "--chat-template", "none", "--reward", "arith"]
    argv += ["--reward-workers", "0", "--n", "2", "--k", "1", "--max-tokens", "3"]
    assert main(argv) == 0
    assert json.loads((exported / "eval_metrics.json").read_text())["arith"]["num_problems"] == 3

    # (6) beside a live run: a dry run works (it takes no lock), a real launch is refused
    from pacs_megatron.run.run_dir import LOCK, this_process

    (out / LOCK).write_text(json.dumps(asdict(this_process())))  # this live process holds the run
    dry = _train(out, "trainer.total_steps=5", "--dry-run")
    assert dry.returncode == 0, dry.stderr[-3000:]  # fails on issue 42's old code: refused by the lock
    assert "# layout" in dry.stdout
    busy = _train(out, "trainer.total_steps=5")
    assert busy.returncode == 2 and "is in use by another run" in busy.stderr, busy.stderr[-2000:]  # a real run is
