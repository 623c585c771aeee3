"""Qwen3-MoE under sequence parallelism (TP=2), forced on CPU (``allow_cpu_sequence_parallel``): each TP
rank's routers see only their ``[s/tp, b]`` shard of every micro-batch.

One 2-rank launch builds the TP=2 + SP actor and a TP=1 (DP=2, EP=2) actor on the same rows and checks
that the step's ``moe/*`` metrics count the whole micro-batch, not one TP rank's shard.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import GROUP, allow_cpu_sequence_parallel, hf_config, make_qwen3, run_config, sample_batch
from _dist import run_distributed

VOCAB = 64
pytestmark = pytest.mark.distributed


def _actor(model_dir, tp, sp):
    from pacs_megatron.actor import MegatronActor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir, tp=tp, dp=2 // tp)
    cfg = replace(
        cfg,
        parallel=replace(cfg.parallel, ep=2, sequence_parallel=sp),
        model=replace(cfg.model, moe_aux_loss_coeff=0.01),
    )
    return MegatronActor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir)), model_dir)


def _lp(actor, batch):
    return actor.compute_logprobs(batch, micro_batch_size=GROUP, temperature=1.0).token_logp


def _body(rank, world, model_dir, batch):
    allow_cpu_sequence_parallel()
    out = {}
    for name, tp, sp in (("sp", 2, True), ("tp1", 1, False)):
        actor = _actor(model_dir, tp, sp)
        out[name] = actor.train_step(batch.with_(old_logp=_lp(actor, batch)))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model_dir = make_qwen3(tmp_path_factory.mktemp("moe_sp") / "m", vocab=VOCAB, moe=True)
    return run_distributed(_body, 2, model_dir, sample_batch(VOCAB, groups=2))


def test_moe_metrics_count_the_whole_sequence_under_sp(results):
    for r in results:
        for key in ("moe/aux_loss", "moe/max_token_share"):
            assert r["sp"][key] == pytest.approx(r["tp1"][key], rel=1e-5), key
    assert results[0]["sp"] == results[1]["sp"], "metrics differ between TP ranks"
    assert torch.isfinite(torch.tensor(results[0]["sp"]["actor/grad_norm"]))
