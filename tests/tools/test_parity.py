"""``pacs-megatron parity`` end to end (it spawns its own ranks), and its report's verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# tests/actor's helpers build the tiny Qwen2 / Qwen3 models, as they do for the actor's own tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "actor"))
from _actor_helpers import make_qwen2, make_qwen3  # noqa: E402

from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.tools.parity import _report, load_samples  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen2(tmp_path_factory.mktemp("parity") / "m", vocab=255, tie=True)


def _parity(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "pacs_megatron", "parity", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.distributed
def test_parity_tool_tp2_with_data_and_out(model_dir, tmp_path):
    rows = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9]}, {"prompt_ids": [1], "response_ids": [2, 3, 4, 250]}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    proc = _parity("--hf-model", model_dir, "--tp", "2", "--pp", "1", "--data", str(data), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["response_ids"] for r in recs] == [r["response_ids"] for r in rows]
    for r in recs:
        assert len(r["megatron_token_logp"]) == len(r["response_ids"]) == len(r["hf_token_logp"])
        assert r["megatron_seq_logp"] == pytest.approx(r["hf_seq_logp"], abs=1e-4)
        assert r["max_abs_diff_token"] <= 1e-5


@pytest.mark.distributed
def test_parity_tool_pp2_builtin_samples(model_dir):
    proc = _parity("--hf-model", model_dir, "--tp", "1", "--pp", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "parity OK" in proc.stderr


@pytest.mark.distributed
def test_parity_tool_ep2_qwen3_moe(tmp_path):
    moe = make_qwen3(tmp_path / "moe", vocab=255, layers=2, moe=True)
    proc = _parity("--hf-model", moe, "--ep", "2", "--tolerance", "1e-5")  # spawns 2 ranks: tp=1 x dp=2, ep=2
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "parity OK" in proc.stderr and "ep=2" in proc.stderr


def test_report_fails_above_tolerance(tmp_path):
    rows = load_samples(None, vocab_size=50)
    batch = build_rollouts([p for p, _ in rows], [r for _, r in rows], [0.0] * len(rows), 1, pad_id=0)
    meg = torch.randn(batch.input_ids.shape)
    assert _report(rows, batch, meg, meg.clone(), 1e-4, None)
    ref = meg.clone()
    b, t = 3, int(batch.seq_lens[3]) - 1  # a response token
    assert batch.response_mask[b, t]
    ref[b, t] += 1e-3
    assert not _report(rows, batch, meg, ref, 1e-4, str(tmp_path / "o.jsonl"))
    rec = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[b])
    assert rec["max_abs_diff_token"] == pytest.approx(1e-3, rel=1e-3)
    # per sequence: small token differences that add up pass on the relative test (--rtol) only
    ref = meg.clone()
    ref[batch.response_mask] += 3e-5
    assert not _report(rows, batch, meg, ref, 1e-4, None)
    assert _report(rows, batch, meg - 100.0, ref - 100.0, 1e-4, None, rtol=1e-5)
