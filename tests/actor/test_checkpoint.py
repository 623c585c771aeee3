"""Actor checkpoints: save at TP=2, load at TP=1 / PP=2 (resharding) and resume at TP=2 (exact).

The model is untied and stored as sharded safetensors with an index, so the same launches also
check the HF import -> export round trip of a sharded checkpoint and save_hf.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _actor_helpers import hf_config, make_qwen2, rel_update_diff, run_config, sample_batch, valid_positions
from _dist import run_distributed
from safetensors.torch import load_file

from pacs_megatron.batch.rows import as_train_batch

VOCAB = 256
EXTRA = {"data_position": 5, "note": "trainer state"}


def _actor(model_dir, tp, pp, world):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    # warm-up + cosine: the resumed step must continue the schedule, not restart it
    cfg = run_config(model_dir, tp=tp, pp=pp, dp=world // (tp * pp), lr_warmup_steps=1, lr_decay_style="cosine")
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    return build_actor(cfg, groups, model_dir)


def _export(actor) -> dict:
    return {n: t.detach().cpu().clone() for n, t in actor.export_hf_weights()}


def _step(actor, batch) -> dict:
    old = actor.compute_logprobs(batch, micro_batch_size=2, temperature=1.0).token_logp
    return actor.train_step(as_train_batch(batch, old))


def _save_body(rank, world, model_dir, ckpt_dir, hf_out):
    actor = _actor(model_dir, tp=2, pp=1, world=world)
    batch = sample_batch(VOCAB)
    out = {"w0": _export(actor)}
    _step(actor, batch)
    _step(actor, batch)
    actor.save_checkpoint(ckpt_dir, EXTRA)
    out["children"] = [p.name for p in multiprocessing.active_children()]
    actor.save_hf(hf_out)
    out["w_saved"] = _export(actor)
    out["lp_saved"] = actor.compute_logprobs(batch, micro_batch_size=2, temperature=1.0).token_logp
    out["m_next"] = _step(actor, batch)
    out["w_next"] = _export(actor)
    return out


def _load_body(rank, world, model_dir, ckpt_dir, tp, pp):
    actor = _actor(model_dir, tp=tp, pp=pp, world=world)
    batch = sample_batch(VOCAB)
    extra = actor.load_checkpoint(ckpt_dir)
    out = {"extra": extra, "iteration": actor.iteration, "w_loaded": _export(actor)}
    out["lp_loaded"] = actor.compute_logprobs(batch, micro_batch_size=2, temperature=1.0).token_logp
    out["m_next"] = _step(actor, batch)
    out["w_next"] = _export(actor)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = make_qwen2(root / "model", vocab=VOCAB, tie=False, shard="60KB")
    (Path(model_dir) / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    ckpt_dir, hf_out = str(root / "step_2"), str(root / "hf_export")
    result = run_distributed(_save_body, 2, model_dir, ckpt_dir, hf_out)[0]
    return model_dir, ckpt_dir, hf_out, result


def _originals(model_dir: str) -> dict:
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(load_file(Path(model_dir) / f))
    return out


@pytest.mark.distributed
def test_sharded_import_export_and_save_hf(saved):
    model_dir, _, hf_out, r = saved
    assert (
        len(set(json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    )
    orig = _originals(model_dir)
    assert set(r["w0"]) == set(orig) and "lm_head.weight" in orig
    assert all(torch.equal(r["w0"][k], orig[k]) for k in orig), "sharded HF -> Megatron TP=2 -> HF not bit-exact"
    written = load_file(Path(hf_out) / "model.safetensors")
    assert set(written) == set(r["w_saved"])
    assert all(torch.equal(written[k], r["w_saved"][k]) for k in written)
    assert (Path(hf_out) / "tokenizer_config.json").is_file()
    assert json.loads((Path(hf_out) / "config.json").read_text())["vocab_size"] == VOCAB


@pytest.mark.distributed
@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (2, 1, 2)], ids=["tp1", "pp2"])
def test_load_with_other_layout(saved, world, tp, pp):
    model_dir, ckpt_dir, _, s = saved
    r = run_distributed(_load_body, world, model_dir, ckpt_dir, tp, pp)[0]
    assert r["extra"] == EXTRA and r["iteration"] == 2
    assert all(torch.equal(r["w_loaded"][k], s["w_saved"][k]) for k in s["w_saved"]), "weights changed on reload"
    valid = valid_positions(sample_batch(VOCAB))
    assert (r["lp_loaded"] - s["lp_saved"])[valid].abs().max() <= 1e-5
    # Optimizer moments and the LR schedule were resharded too: the next update matches TP=2's.
    assert r["m_next"]["actor/lr"] == pytest.approx(s["m_next"]["actor/lr"], rel=1e-12)
    assert r["m_next"]["pacs/loss"] == pytest.approx(s["m_next"]["pacs/loss"], rel=1e-5)
    assert rel_update_diff(s["w_saved"], s["w_next"], r["w_loaded"], r["w_next"]) <= 1e-5


@pytest.mark.distributed
def test_resume_same_layout_is_exact(saved):
    model_dir, ckpt_dir, _, s = saved
    r = run_distributed(_load_body, 2, model_dir, ckpt_dir, 2, 1)[0]
    assert torch.equal(r["lp_loaded"], s["lp_saved"])
    assert r["m_next"] == s["m_next"], "resumed step's loss/metrics differ from the uninterrupted run"
    assert all(torch.equal(r["w_next"][k], s["w_next"][k]) for k in s["w_next"])


@pytest.mark.distributed
def test_a_save_leaves_no_helper_process(saved):
    """Megatron's writer reports through an in-process queue (actor/checkpoint.py): no Manager server is
    spawned (it cost a launch's first save 7-8 s and died of a job-wide SIGTERM), and its forked writers
    are joined."""
    assert saved[3]["children"] == []


# Reads every pickle of the checkpoint as data (run/checkpoint_data.py) in a process that never imported
# megatron, as the launcher does: megatron's own allow-list (registered on import) must not be needed.
_CHECK_AS_DATA = """
import sys
from pacs_megatron.run.checkpoint_data import check_objects, load_common, read_metadata
meg = sys.argv[1] + "/megatron"
common = load_common(meg)
check_objects(meg, read_metadata(meg))
assert "megatron" not in sys.modules
print(common["layout"])
"""


@pytest.mark.distributed
def test_real_checkpoint_reads_as_data(saved):
    """A megatron-core 0.16.1 checkpoint (TP=2, RNG states, modules' _extra_state) holds only allowed data."""
    ckpt_dir = saved[1]
    proc = subprocess.run([sys.executable, "-c", _CHECK_AS_DATA, ckpt_dir], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "'tp': 2" in proc.stdout, proc.stderr[-2000:]
