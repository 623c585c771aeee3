"""The MoE load-balancing (aux) loss gives one gradient whatever the RL loss, the padding, the batching
and the layout: ``model.moe_aux_loss_coeff`` x the token-weighted mean over the mini-batch's micro-batches
of each MoE layer's ``E * sum_e f_e * P_e`` over real tokens.

The aux-induced gradient is measured as grad(coeff) - grad(0) of two actors on the same weights and
rows (the optimizer step is skipped, the router weights' main grads are read after finalize). One
2-rank launch, every layout holding the whole batch per replica:
- TP=1, DP=2 (each DP rank the same rows: sums over DP then equal one replica's): PACS (rows as loss
  units), GRPO and PPO (response tokens), fixed and token-budget micro-batches of the same groups (other
  padding, other order); and the first mini-batch's step that takes its old log-probs from its own
  forward (``train_step_from_forward``, no ``old_logp`` given);
- TP=2 with sequence parallelism (forced on CPU): each TP rank routes its shard;
- PP=2 x VPP=2 over 3 micro-batches: the interleaved schedule adds one dummy micro-batch.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
from _dist import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/actor/_actor_helpers.py
from _actor_helpers import (
    GROUP,
    allow_cpu_sequence_parallel,
    hf_config,
    make_qwen3,
    run_config,
    sample_batch,
    set_algorithm,
)

from pacs_megatron.batch.rows import TrainRows, as_train_batch

VOCAB = 64
GROUPS = 3  # micro-batches of one group: 3, so the interleaved schedule pads one
COEFF = 0.5
pytestmark = pytest.mark.distributed
LAYOUTS = {"ref": (1, 1, 1, 2), "sp": (2, 1, 1, 1), "vpp": (1, 2, 2, 1)}
"""name -> (tp, pp, vpp, dp)"""


def _actor(model_dir, layout, coeff):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    tp, pp, vpp, dp = LAYOUTS[layout]
    cfg = run_config(model_dir, tp=tp, pp=pp, dp=dp, vpp=vpp)
    cfg = replace(
        cfg,
        parallel=replace(cfg.parallel, ep=2 if tp * dp == 2 else 1, sequence_parallel=tp > 1),
        model=replace(cfg.model, moe_aux_loss_coeff=coeff),
        data=replace(cfg.data, max_prompt_length=8),
        rollout=replace(cfg.rollout, max_response_length=8),
        # one group per micro-batch in both modes: the same partition, different padding and order
        algorithm=replace(cfg.algorithm, micro_batch_size=GROUP, max_tokens_per_micro_batch=GROUP * 16),
    )
    return build_actor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir)), model_dir)


def _router_grads(actor, batch, loss, dynamic, from_forward=False):
    """Per global layer, the router weight's gradient of one train step (the step itself skipped)."""
    from pacs_megatron.actor.moe.routing import routers

    set_algorithm(actor, replace(actor.sections.train.algorithm, dynamic_batching=dynamic))
    grads = {}

    def capture(metrics):
        for layer, router in routers(actor.model):
            grads[layer] = router.weight.main_grad.detach().clone()
        return {}

    actor._optimizer_step = capture
    if from_forward:  # pi_theta = pi_old: the loss units must not need old_logp
        actor.train_step_from_forward(TrainRows.of(batch, advantages=batch.advantages))  # no old log-probs
    else:
        actor.train_step(batch, loss_name=loss)
    return grads


RUNS = {
    "ref": [(loss, dyn, False) for loss in ("pacs", "grpo", "ppo") for dyn in (False, True)]
    + [("pacs", False, True), ("pacs", True, True)],
    "sp": [("pacs", False, False)],
}
"""layout -> (loss, dynamic batching, old log-probs from the training forward)"""


def _body(rank, world, model_dir, batch):
    allow_cpu_sequence_parallel()
    out = {}
    for layout in LAYOUTS:
        with_aux, without = _actor(model_dir, layout, COEFF), _actor(model_dir, layout, 0.0)
        old = with_aux.compute_logprobs(batch, micro_batch_size=GROUP, temperature=1.0).token_logp
        b = as_train_batch(batch, old)
        for loss, dyn, fwd in RUNS.get(layout, [("pacs", False, False)]):
            g1, g0 = _router_grads(with_aux, b, loss, dyn, fwd), _router_grads(without, b, loss, dyn, fwd)
            out[(layout, loss, dyn, fwd)] = {layer: g1[layer] - g0[layer] for layer in g1}
    return out


@pytest.fixture(scope="module")
def aux_grads(tmp_path_factory):
    model_dir = make_qwen3(tmp_path_factory.mktemp("moe_aux") / "m", vocab=VOCAB, moe=True)
    results = run_distributed(_body, 2, model_dir, sample_batch(VOCAB, groups=GROUPS))
    merged = {}
    for r in results:  # pipeline stages hold different layers
        for key, grads in r.items():
            merged.setdefault(key, {}).update(grads)
    return merged


def _rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    num = max(float((a[k] - b[k]).abs().max()) for k in a)
    return num / max(float(a[k].abs().max()) for k in a)


def test_aux_gradient_is_independent_of_the_rl_loss_and_the_batching(aux_grads):
    ref = aux_grads[("ref", "pacs", False, False)]
    assert max(float(g.abs().max()) for g in ref.values()) > 1e-3, "no aux gradient to compare"
    for loss, dyn, fwd in RUNS["ref"]:
        assert _rel(ref, aux_grads[("ref", loss, dyn, fwd)]) <= 1e-4, (loss, "dynamic" if dyn else "fixed", fwd)


@pytest.mark.parametrize("layout", ["sp", "vpp"])
def test_aux_gradient_is_independent_of_the_layout_and_dummy_micro_batches(aux_grads, layout):
    assert _rel(aux_grads[("ref", "pacs", False, False)], aux_grads[(layout, "pacs", False, False)]) <= 1e-4, layout
