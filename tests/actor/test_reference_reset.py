"""PACS v2's hard reset of the reference policy (algorithm.reference_reset_every), in the Megatron actor.

One launch per layout (single process; DP=2 with the distributed optimizer, whose Adam state is sharded over
the two ranks; TP=2 with the reference and the optimizer state offloaded to host; PP=2 with two virtual
stages; EP=2 on a MoE model, each rank holding two of its four experts). Actor A trains one PACS step anchored
on the reference (algorithm.pacs.anchor=reference), writes its weights W1 as a Hugging Face model, resets, and trains a
second step. Actor B is built fresh from W1 (a fresh optimizer, its reference a copy of W1) and trains the
same second step. A reset is ProRL's restart from the live policy, so A's second update equals B's bit for
bit (fp32), and after the reset A's reference log-probs equal its policy's bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import hf_config, make_qwen2, make_qwen3, run_config, sample_batch
from _dist import run_distributed

from pacs_megatron.batch.rows import as_train_batch

VOCAB = 255
# layout: (world, tp, pp, vpp, offload, ep); DP is what the world leaves; EP > 1 trains a MoE model (4 experts)
LAYOUTS = {
    "single": (1, 1, 1, 1, False, 1),
    "dp2_distopt": (2, 1, 1, 1, False, 1),
    "tp2_offload": (2, 2, 1, 1, True, 1),
    "pp2_vpp2": (2, 1, 2, 2, False, 1),
    "ep2_moe": (2, 1, 1, 1, False, 2),
}


def _config(model_dir, world, tp, pp, vpp, offload, ep):
    dp = world // (tp * pp)
    distopt = "true" if dp > 1 and ep == 1 else "auto"
    cfg = run_config(model_dir, tp=tp, pp=pp, dp=dp, vpp=vpp, use_distributed_optimizer=distopt)
    cfg = replace(cfg, parallel=replace(cfg.parallel, ep=ep))
    pacs = replace(cfg.algorithm.pacs, anchor="reference")
    algo = replace(cfg.algorithm, loss="pacs", pacs=pacs, reference_reset_every=1)
    actor = replace(cfg.actor, offload_reference=offload, offload_during_rollout=offload)
    return replace(cfg, algorithm=algo, actor=actor)


def _step(actor, batch):
    """One PACS step on ``batch`` with the old and reference log-probs the trainer's stages would give it."""
    old = actor.compute_logprobs(batch, 2, 1.0).token_logp
    ref = actor.compute_ref_logprobs(batch, 2, 1.0)
    metrics = actor.train_step(as_train_batch(batch, old, ref_logp=ref))
    actor.offload()
    return metrics, old, ref


def _weights(actor) -> dict:
    return {n: t.detach().cpu().clone() for n, t in actor.export_hf_weights()}


def _body(rank, world, model_dir, tp, pp, vpp, offload, ep, w1_dir):
    import torch.distributed as dist

    from pacs_megatron.batch.build import dp_shard
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = _config(model_dir, world, tp, pp, vpp, offload, ep)
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    b1, b2 = (dp_shard(sample_batch(VOCAB, seed=s), groups.dp_rank, groups.dp_size) for s in (1, 2))
    a = build_actor(cfg, groups, model_dir)
    m1, _, _ = _step(a, b1)
    a.save_hf(w1_dir)
    dist.barrier()
    a.reset_reference()
    states = [s for o in getattr(a.optimizer, "chained_optimizers", [a.optimizer]) for s in o.optimizer.state.values()]
    zeroed = bool(states) and all(bool((v == 0).all()) for s in states for v in s.values() if torch.is_tensor(v))
    a.offload()
    ref_is_policy = torch.equal(a.compute_ref_logprobs(b2, 2, 1.0), a.compute_logprobs(b2, 2, 1.0).token_logp)
    m2a, _, ref2 = _step(a, b2)
    frozen = torch.equal(a.compute_ref_logprobs(b2, 2, 1.0), ref2)
    wa = _weights(a)
    b = build_actor(replace(cfg, model=replace(cfg.model, path=w1_dir)), groups, w1_dir)
    m2b, _, _ = _step(b, b2)
    wb = _weights(b)
    same = all(torch.equal(wa[k], wb[k]) for k in wa)
    return dict(m1=m1, m2a=m2a, m2b=m2b, zeroed=zeroed, ref_is_policy=ref_is_policy, frozen=frozen, same=same)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen2(tmp_path_factory.mktemp("qwen2_reset") / "m", vocab=VOCAB, tie=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_qwen3(tmp_path_factory.mktemp("qwen3_moe_reset") / "m", vocab=VOCAB, moe=True)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reset_equals_a_restart_from_the_live_policy(layout, model_dir, moe_dir, tmp_path):
    world, tp, pp, vpp, offload, ep = LAYOUTS[layout]
    model = moe_dir if ep > 1 else model_dir
    results = run_distributed(_body, world, model, tp, pp, vpp, offload, ep, str(tmp_path / "w1"))
    for r in results:
        assert r["zeroed"], f"{layout}: the optimizer state was not re-initialised"
        assert r["ref_is_policy"], f"{layout}: after the reset the reference is not the live policy"
        assert r["frozen"], f"{layout}: the reference moved with the update"
        assert r["same"], f"{layout}: the update after a reset differs from a fresh start at the same weights"
        # PACS v2: the first step's psi is 0 (policy == reference); after the reset and one update it is not
        assert r["m1"]["pacs/psi_abs_mean"] == 0.0
        assert r["m2a"]["pacs/loss"] == r["m2b"]["pacs/loss"]
        assert r["m2a"]["actor/grad_norm"] == r["m2b"]["actor/grad_norm"]
