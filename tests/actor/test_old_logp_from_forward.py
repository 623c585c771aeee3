"""``algorithm.old_logp_from_forward``: the first mini-batch takes its old log-probs from its own training
forward instead of the separate no-grad pass, and nothing else changes.

Each case runs the step's two actor stages (``prepare_local_batch`` then ``update_actor``) twice from the
same weights, with the switch off (the pass over every row) and on, and requires the same old log-probs,
entropy, metrics and updated weights, bit for bit: on CPU the fused kernel is batch-invariant and both
passes run the same micro-batches, so pi_theta's forward before the first update *is* pi_old's.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import hf_config, make_qwen2, run_config, sample_batch
from _dist import run_distributed

VOCAB = 255

# name -> (world, tp, pp, loss, mini-batch prompts (0: one update per step), ppo epochs, dynamic batching)
CASES = {
    "grpo_one_update": (1, 1, 1, "grpo", 0, 1, False),
    "pacs_two_minibatches_two_epochs": (1, 1, 1, "pacs", 2, 2, True),
    "pp2_pacs_two_minibatches": (2, 1, 2, "pacs", 2, 1, True),
}


def _run(model_dir, tp, pp, loss, mini, epochs, dynamic, from_forward):
    from pacs_megatron.loop import update_stages
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir, tp=tp, pp=pp, lr=1e-2, adam_eps=1e-8)
    algo = replace(
        cfg.algorithm,
        loss=loss,
        mini_batch_size=mini,
        ppo_epochs=epochs,
        dynamic_batching=dynamic,
        micro_batch_size=2,
        old_logp_from_forward=from_forward,
    )
    cfg = replace(cfg, algorithm=algo)
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    actor = build_actor(cfg, groups, model_dir)
    batch = sample_batch(VOCAB)
    rows, old, m1 = update_stages.prepare_local_batch(cfg, actor, batch, groups.dp_rank, groups.dp_size)
    skipped = old.first > 0 and len(old.logp) == len(rows) - old.first  # no pass over the first rows
    m2 = update_stages.update_actor(cfg, actor, rows, old, groups.dp_size)
    metrics = {k: float(v) for k, v in (m1 | m2).items()}
    weights = {n: t.detach().cpu().clone() for n, t in actor.export_hf_weights()}
    return {"metrics": metrics, "weights": weights, "pass_skipped": skipped}


def _body(rank, world, model_dir, cases):  # noqa: ARG001
    out = {}
    for case in cases:  # one launch per world size: process start dominates
        _, tp, pp, loss, mini, epochs, dynamic = CASES[case]
        out[case] = [_run(model_dir, tp, pp, loss, mini, epochs, dynamic, flag) for flag in (False, True)]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen2(tmp_path_factory.mktemp("qwen2_oldlogp") / "m", vocab=VOCAB, tie=True)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_same_step_without_the_old_logprob_pass(world, model_dir):
    cases = [k for k, c in CASES.items() if c[0] == world]
    results = run_distributed(_body, world, model_dir, cases)
    for case in cases:
        for before, after in (r[case] for r in results):
            _check(case, before, after)


def _check(case, before, after):
    assert not before["pass_skipped"], "switch off: the no-grad pass must fill every row"
    assert after["pass_skipped"], "switch on: the first mini-batch's rows must wait for their forward"
    assert before["metrics"].keys() == after["metrics"].keys()
    for key, value in before["metrics"].items():
        assert after["metrics"][key] == value, f"{case}: {key} {after['metrics'][key]!r} != {value!r}"
    assert before["metrics"]["actor/grad_norm"] > 0
    for name, w in before["weights"].items():
        assert torch.equal(after["weights"][name], w), f"{case}: {name} differs after the step"
