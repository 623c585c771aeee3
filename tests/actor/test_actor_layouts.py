"""The actor under TP / PP / VPP / DP layouts equals one process and Hugging Face transformers.

One launch per layout runs every check of that layout (process start dominates the cost):
HF import -> export round trip (bit-exact), log-probs vs HF, batch invariance of compute_logprobs,
the group-splitting guard, one PACS step and one GRPO step (weights gathered with
export_hf_weights after each), and ``actor/max_abs_logratio == 0`` in the first training forward.
"""

from __future__ import annotations

import pytest
import torch
from _actor_helpers import (
    hf_config,
    hf_logprobs,
    make_qwen2,
    rel_update_diff,
    run_config,
    sample_batch,
    valid_positions,
)
from _dist import run_distributed
from safetensors.torch import load_file

from pacs_megatron.batch.build import dp_shard
from pacs_megatron.batch.rows import as_train_batch

VOCAB = 255  # not a multiple of 2: TP=2 pads the vocabulary

# name -> (world size, tp, pp, vpp, train micro-batch size)
LAYOUTS = {
    "single": (1, 1, 1, 1, 4),
    "tp2": (2, 2, 1, 1, 4),
    "pp2": (2, 1, 2, 1, 4),
    "dp2": (2, 1, 1, 1, 4),
    "tp2pp2": (4, 2, 2, 1, 4),
    "pp2dp2": (4, 1, 2, 1, 4),
    # one 8-row micro-batch: the interleaved schedule needs >= pp, so it is padded with a dummy
    "pp2vpp2": (2, 1, 2, 2, 8),
}


def _export(actor) -> dict:
    return {n: t.detach().cpu().clone() for n, t in actor.export_hf_weights()}


def _layout_body(rank, world, model_dir, tp, pp, vpp, mbs):
    from dataclasses import replace

    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir, tp=tp, pp=pp, dp=world // (tp * pp), vpp=vpp)
    cfg = replace(cfg, algorithm=replace(cfg.algorithm, micro_batch_size=mbs))
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    actor = build_actor(cfg, groups, model_dir)
    out = {"dp_rank": groups.dp_rank}
    inner = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
    out["fused_adam"] = all(g["fused"] for o in inner for g in o.param_groups)
    w0 = _export(actor)

    local = dp_shard(sample_batch(VOCAB), groups.dp_rank, groups.dp_size)
    small = actor.compute_logprobs(local, micro_batch_size=2, temperature=1.0, with_entropy=True)
    big = actor.compute_logprobs(local, micro_batch_size=len(local), temperature=1.0, with_entropy=True)
    out["invariant"] = torch.equal(small.token_logp, big.token_logp) and torch.equal(small.entropy, big.entropy)
    out["token_logp"] = small.token_logp
    out["hot_logp"] = actor.compute_logprobs(local, micro_batch_size=2, temperature=0.5).token_logp
    try:
        actor.compute_logprobs(local, micro_batch_size=1, temperature=1.0)  # splits groups of 2
        out["guard"] = False
    except ValueError:
        out["guard"] = True

    m_pacs = actor.train_step(as_train_batch(local, small.token_logp))
    w1 = _export(actor)
    old = actor.compute_logprobs(local, micro_batch_size=2, temperature=1.0).token_logp
    m_grpo = actor.train_step(as_train_batch(local, old), loss_name="grpo")
    w2 = _export(actor)
    out.update(m_pacs=m_pacs, m_grpo=m_grpo)
    if rank == 0:
        out.update(w0=w0, w1=w1, w2=w2)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen2(tmp_path_factory.mktemp("qwen2_tied") / "m", vocab=VOCAB, tie=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    world, tp, pp, vpp, mbs = LAYOUTS["single"]
    return run_distributed(_layout_body, world, model_dir, tp, pp, vpp, mbs)[0]


def _gather_dp(results, key):
    by_dp = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], r[key])
    return torch.cat([by_dp[k] for k in sorted(by_dp)])


@pytest.mark.distributed
def test_single_process_matches_hf(reference, model_dir):
    batch = sample_batch(VOCAB)
    valid = valid_positions(batch)
    orig = load_file(f"{model_dir}/model.safetensors")
    assert set(reference["w0"]) == set(orig)
    assert all(torch.equal(reference["w0"][k], orig[k]) for k in orig), "HF -> Megatron -> HF is not bit-exact"
    hf = hf_logprobs(model_dir, batch.input_ids)
    assert (reference["token_logp"] - hf)[valid].abs().max() <= 1e-5
    hot = hf_logprobs(model_dir, batch.input_ids, temperature=0.5)
    assert (reference["hot_logp"] - hot)[valid].abs().max() <= 1e-5
    assert reference["invariant"] and reference["guard"]
    assert reference["fused_adam"], "on CPU the actor's Adam runs torch's fused kernel (actor/optimizer.py)"
    # Unchanged weights: the training forward reproduces the old log-probs bit for bit.
    assert reference["m_pacs"]["actor/max_abs_logratio"] == 0.0
    assert reference["m_grpo"]["actor/max_abs_logratio"] == 0.0
    assert reference["m_pacs"]["actor/skipped_steps"] == 0.0
    assert reference["m_pacs"]["actor/lr"] == pytest.approx(0.5)
    moved = max(float((reference["w1"][k] - reference["w0"][k]).abs().max()) for k in orig)
    assert moved > 1e-4, "the PACS step did not change the weights"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "single"])
def test_layout_matches_single_process(layout, reference, model_dir):
    world, tp, pp, vpp, mbs = LAYOUTS[layout]
    results = run_distributed(_layout_body, world, model_dir, tp, pp, vpp, mbs)
    head = results[0]
    batch = sample_batch(VOCAB)
    valid = valid_positions(batch)
    orig = load_file(f"{model_dir}/model.safetensors")
    assert all(torch.equal(head["w0"][k], orig[k]) for k in orig), f"{layout}: import/export not bit-exact"
    for r in results:
        assert r["invariant"], f"{layout}: compute_logprobs depends on the micro-batch size"
        assert r["guard"], f"{layout}: a micro-batch splitting a prompt group was accepted"
        assert r["m_pacs"] == head["m_pacs"] and r["m_grpo"] == head["m_grpo"], "metrics differ between ranks"
    token_logp = _gather_dp(results, "token_logp")
    hf = hf_logprobs(model_dir, batch.input_ids)
    assert (token_logp - hf)[valid].abs().max() <= 1e-5
    assert (token_logp - reference["token_logp"])[valid].abs().max() <= 1e-5
    assert head["m_pacs"]["actor/max_abs_logratio"] == 0.0
    for key in ("pacs/loss", "actor/grad_norm"):
        assert head["m_pacs"][key] == pytest.approx(reference["m_pacs"][key], rel=1e-5)
    for key in ("policy/loss", "actor/grad_norm"):
        assert head["m_grpo"][key] == pytest.approx(reference["m_grpo"][key], rel=1e-4, abs=1e-7)
    assert rel_update_diff(reference["w0"], reference["w1"], head["w0"], head["w1"]) <= 1e-5, (
        f"{layout}: PACS update differs"
    )
    assert rel_update_diff(reference["w1"], reference["w2"], head["w1"], head["w2"]) <= 1e-5, (
        f"{layout}: GRPO update differs"
    )
