"""Qwen3-MoE with expert parallelism: conversion, parity with transformers, MoE metrics, checkpoint
resume at EP=2 (bit-identical), and routing replay against the HF engine's recorded experts.

Launches (process start dominates): one EP=2 run that trains and saves, one that resumes it and then
builds TP=2 x EP=2, and one 4-rank EP=2 x PP=2.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import (
    GROUP,
    hf_config,
    hf_engine_rollout,
    hf_logprobs,
    make_qwen3,
    run_config,
    shift_experts,
    valid_positions,
)
from _dist import run_distributed
from safetensors.torch import load_file

from pacs_megatron.batch.rows import as_train_batch

VOCAB = 64
EXTRA = {"step": 2}
pytestmark = pytest.mark.distributed


def _actor(model_dir, tp=1, pp=1, ep=2, world=2, replay="none"):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir, tp=tp, pp=pp, dp=world // (tp * pp))
    cfg = replace(
        cfg,
        parallel=replace(cfg.parallel, ep=ep),
        model=replace(cfg.model, moe_aux_loss_coeff=0.01),
        actor=replace(cfg.actor, routing_replay=replay),
    )
    # TP > 1 trains MoE only with sequence parallelism (TE/Apex): forward passes only there
    return build_actor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir), training=tp == 1), model_dir)


def _export(actor) -> dict:
    return {n: t.detach().cpu().clone() for n, t in actor.export_hf_weights()}


def _lp(actor, batch):
    return actor.compute_logprobs(batch, micro_batch_size=GROUP, temperature=1.0).token_logp


def _step(actor, batch):
    return actor.train_step(as_train_batch(batch, _lp(actor, batch)))


def _train_body(rank, world, model_dir, ckpt_dir, batch):
    actor = _actor(model_dir, replay="rollout")
    out = {"w0": _export(actor), "lp_route": _lp(actor, replace(batch, routed_experts=None))}
    out["lp_replay"] = _lp(actor, batch)
    out["lp_shifted"] = _lp(actor, shift_experts(batch, 4))  # other experts: the replay must change the log-probs
    out["m1"] = _step(actor, batch)
    _step(actor, batch)
    actor.save_checkpoint(ckpt_dir, EXTRA)
    out["w_saved"] = _export(actor)
    out["lp_saved"] = _lp(actor, batch)
    out["m_next"] = _step(actor, batch)
    out["w_next"] = _export(actor)
    return out


def _resume_body(rank, world, model_dir, ckpt_dir, batch):
    actor = _actor(model_dir, replay="rollout")
    out = {"extra": actor.load_checkpoint(ckpt_dir), "w_loaded": _export(actor), "lp_loaded": _lp(actor, batch)}
    out["m_next"] = _step(actor, batch)
    out["w_next"] = _export(actor)
    tp2 = _actor(model_dir, tp=2, ep=2)
    out["tp2_w0"], out["tp2_lp"] = _export(tp2), _lp(tp2, replace(batch, routed_experts=None))
    return out


def _pp_body(rank, world, model_dir, batch):
    actor = _actor(model_dir, pp=2, ep=2, world=4)
    return {"w0": _export(actor), "lp": _lp(actor, replace(batch, routed_experts=None))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    model_dir = make_qwen3(root / "m", vocab=VOCAB, moe=True)
    batch, engine_lp = hf_engine_rollout(model_dir, seed=3, max_tokens=6)
    r = run_distributed(_train_body, 2, model_dir, str(root / "ckpt"), batch)
    return model_dir, str(root / "ckpt"), batch, engine_lp, r


def _check_parity(model_dir, batch, w0, lp, what):
    orig = load_file(f"{model_dir}/model.safetensors")
    assert set(w0) == set(orig) and all(torch.equal(w0[k], orig[k]) for k in orig), f"{what}: round trip"
    hf = hf_logprobs(model_dir, batch.input_ids)
    valid = valid_positions(batch)
    assert (lp - hf)[valid].abs().max() <= 1e-5, what
    m = batch.response_mask
    hf_seq, seq = (hf * m).sum(-1), (lp * m).sum(-1)
    assert ((seq - hf_seq).abs() / hf_seq.abs()).max() <= 1e-5, what


def test_ep2_parity_round_trip_metrics_and_replay(trained):
    model_dir, _, batch, engine_lp, results = trained
    r = results[0]
    _check_parity(model_dir, batch, r["w0"], r["lp_route"], "ep2")
    m = batch.response_mask
    # routing replay: the engine's experts give the engine's log-probs; other experts do not
    assert (r["lp_replay"] - engine_lp)[m].abs().max() <= 1e-5
    assert (r["lp_shifted"] - engine_lp)[m].abs().max() > 1e-2
    # per-step MoE metrics, identical on every rank; the router learns under replay (gate gradients)
    assert {"moe/aux_loss", "moe/max_token_share"} <= set(r["m1"])
    assert 1.0 <= r["m1"]["moe/max_token_share"] <= 4.0 and 0.5 < r["m1"]["moe/aux_loss"] < 2.0
    assert results[1]["m1"] == r["m1"]
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(r["w_saved"][gate], r["w0"][gate])
    assert all(torch.isfinite(torch.tensor(v)) for v in r["m_next"].values())


def test_ep2_resume_is_bit_identical_then_tp2_ep2_parity(trained):
    model_dir, ckpt_dir, batch, _, saved = trained
    s = saved[0]
    r = run_distributed(_resume_body, 2, model_dir, ckpt_dir, batch)[0]
    assert r["extra"] == EXTRA
    assert all(torch.equal(r["w_loaded"][k], s["w_saved"][k]) for k in s["w_saved"])
    assert torch.equal(r["lp_loaded"], s["lp_saved"])
    assert r["m_next"] == s["m_next"], "resumed step differs from the uninterrupted run"
    assert all(torch.equal(r["w_next"][k], s["w_next"][k]) for k in s["w_next"])
    _check_parity(model_dir, batch, r["tp2_w0"], r["tp2_lp"], "tp2 x ep2")


def test_ep2_pp2_parity(trained):
    model_dir, _, batch, _, _ = trained
    r = run_distributed(_pp_body, 4, model_dir, batch)[0]
    _check_parity(model_dir, batch, r["w0"], r["lp"], "ep2 x pp2")
