"""Qwen3-MoE on the GPU-only layouts, forced on CPU: sequence parallelism (``allow_cpu_sequence_parallel``:
each TP rank's routers see only their ``[s/tp, b]`` shard) and THD packing (the rows of a micro-batch
concatenated into one ``[N, 1]`` sequence; on CPU through actor/attention.py's SDPA, restarted per row as
TE does on GPU).

One 2-rank launch builds, on the same weights and the HF engine's rollout (experts recorded):
TP=2 + SP, TP=2 + SP + THD, THD at TP=1, and plain TP=1 (DP=2, EP=2 everywhere), and checks
- parity with transformers on every forced layout (the stand-ins are exact);
- routing replay on each: the engine's experts give the engine's log-probs, other experts do not
  (the THD branch once skipped replay; under SP the routers got whole-sequence indices and crashed);
- a training step under replay runs on each, and ``moe/*`` counts the whole micro-batch under SP and
  the real tokens only (THD packs other padding).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import (
    GROUP,
    allow_cpu_sequence_parallel,
    hf_config,
    hf_engine_rollout,
    hf_logprobs,
    make_qwen3,
    run_config,
    shift_experts,
    valid_positions,
)
from _dist import run_distributed

from pacs_megatron.batch.rows import as_train_batch

VOCAB = 64
pytestmark = pytest.mark.distributed
LAYOUTS = {"sp": (2, True, False), "sp_thd": (2, True, True), "thd": (1, False, True), "tp1": (1, False, False)}
"""name -> (tp, sequence parallel, THD)"""


def _actor(model_dir, tp, sp, thd):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir, tp=tp, dp=2 // tp)
    cfg = replace(
        cfg,
        parallel=replace(cfg.parallel, ep=2, sequence_parallel=sp),
        model=replace(cfg.model, moe_aux_loss_coeff=0.01),
        actor=replace(cfg.actor, routing_replay="rollout"),
    )
    actor = build_actor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir)), model_dir)
    actor.thd = thd  # what use_thd() decides with dynamic batching; forced, so one config runs every layout
    return actor


def _lp(actor, batch):
    return actor.compute_logprobs(batch, micro_batch_size=GROUP, temperature=1.0).token_logp


def _body(rank, world, model_dir, batch):
    allow_cpu_sequence_parallel()
    out = {}
    for name, (tp, sp, thd) in LAYOUTS.items():
        actor = _actor(model_dir, tp, sp, thd)
        r = {"route": _lp(actor, replace(batch, routed_experts=None)), "replay": _lp(actor, batch)}
        r["shifted"] = _lp(actor, shift_experts(batch, 4))
        r["m"] = actor.train_step(as_train_batch(batch, r["replay"]))
        out[name] = r
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model_dir = make_qwen3(tmp_path_factory.mktemp("moe_forced") / "m", vocab=VOCAB, moe=True)
    batch, engine_lp = hf_engine_rollout(model_dir, seed=5, max_tokens=7)
    return model_dir, batch, engine_lp, run_distributed(_body, 2, model_dir, batch)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_and_routing_replay(trained, layout):
    model_dir, batch, engine_lp, results = trained
    hf = hf_logprobs(model_dir, batch.input_ids)
    valid, m = valid_positions(batch), batch.response_mask
    for r in (res[layout] for res in results):
        assert (r["route"] - hf)[valid].abs().max() <= 1e-5, f"{layout}: parity with transformers"
        assert (r["replay"] - engine_lp)[m].abs().max() <= 1e-5, f"{layout}: replay of the engine's experts"
        assert (r["shifted"] - engine_lp)[m].abs().max() > 1e-2, f"{layout}: other experts changed nothing"
        assert r["m"]["actor/max_abs_logratio"] <= 1e-5 and torch.isfinite(torch.tensor(r["m"]["actor/grad_norm"]))


def test_moe_metrics_count_the_whole_sequence_under_sp(trained):
    results = trained[3]
    for r in results:
        for layout in ("sp", "sp_thd", "thd"):
            for key in ("moe/aux_loss", "moe/max_token_share"):
                assert r[layout]["m"][key] == pytest.approx(r["tp1"]["m"][key], rel=1e-5), (layout, key)
    assert results[0]["sp"]["m"] == results[1]["sp"]["m"], "metrics differ between TP ranks"
