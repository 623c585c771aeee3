"""The LM head on response tokens only (actor/logit_rows.py) gives the full pass's results where they are read.

One launch per world size runs every case of it (process start dominates): the response tokens' log-probs
and entropy of ``compute_logprobs(response_only=True)`` equal the full pass's (fp32, allclose) and hold 0
elsewhere; the training forward's loss sees logits of exactly the selected rows (``[1, n, V]``, n = the
response tokens, not b * T); and a whole RL step (reference KL, entropy bonus, old log-probs, update:
``stages.prepare_local_batch`` + ``update_actor``) gives the same metrics and weights with the selection
on and off. Cases: fixed and token-budget (THD-packed) micro-batches, PP=2, PP=2 x VPP=2 and TP=2 (the
vocabulary split over ranks). Sequence parallelism needs TE or Apex (not on CPU): there the output layer
gathers the sequence itself and no rows are selected (``selects_rows``, checked without a model).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from _actor_helpers import GROUP, hf_config, make_qwen2, run_config, sample_batch
from _dist import run_distributed

from pacs_megatron.actor.logit_rows import selects_rows

VOCAB = 255

# name -> (world, tp, pp, vpp, sequence parallel, dynamic batching)
CASES = {
    "fixed": (1, 1, 1, 1, False, False),
    "dynamic": (1, 1, 1, 1, False, True),
    "pp2_dynamic": (2, 1, 2, 1, False, True),
    "pp2vpp2_fixed": (2, 1, 2, 2, False, False),
    "tp2_fixed": (2, 2, 1, 1, False, False),
}


def _config(model_dir, tp, pp, vpp, sp, dynamic):
    cfg = run_config(model_dir, tp=tp, pp=pp, vpp=vpp, lr=1e-2, adam_eps=1e-8)
    algo = replace(
        cfg.algorithm, loss="grpo", dynamic_batching=dynamic, kl_loss_coef=0.5, kl_loss_type="k3", entropy_coeff=0.1
    )
    return replace(cfg, algorithm=algo, parallel=replace(cfg.parallel, sequence_parallel=sp))


def _case(model_dir, tp, pp, vpp, sp, dynamic):
    import pacs_megatron.actor.train_step as ts
    from pacs_megatron import stages
    from pacs_megatron.actor import MegatronActor
    from pacs_megatron.parallel import initialize_parallel

    cfg = _config(model_dir, tp, pp, vpp, sp, dynamic)
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    batch = sample_batch(VOCAB)
    out = {"last": groups.is_last_stage}
    steps = {}
    for on in (True, False):
        actor = MegatronActor(cfg, groups, model_dir)
        actor.response_logits = on
        lp = actor.compute_logprobs(batch, GROUP, 1.0, with_entropy=True, response_only=True)
        out[f"logp_{on}"], out[f"entropy_{on}"] = lp.token_logp, lp.entropy
        rows = []  # the rows of the logits each training loss function sees
        real = ts.token_logprobs
        ts.token_logprobs = partial(_recording, rows, real)
        try:
            local, m1 = stages.prepare_local_batch(cfg, actor, batch, groups.dp_rank, groups.dp_size)
            m2 = stages.update_actor(cfg, actor, local, groups.dp_size)
        finally:
            ts.token_logprobs = real
        out[f"rows_{on}"] = rows
        weights = {n: t.detach().clone() for n, t in actor.export_hf_weights()}
        steps[on] = ({k: float(v) for k, v in (m1 | m2).items()}, weights)
    out["steps"] = steps
    return out


def _recording(seen: list, real, logits, *args, **kwargs):
    seen.append(tuple(logits.shape[:-1]))
    return real(logits, *args, **kwargs)


def _body(rank, world, model_dir, cases):  # noqa: ARG001
    return {case: _case(model_dir, *CASES[case][1:]) for case in cases}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen2(tmp_path_factory.mktemp("qwen2_rows") / "m", vocab=VOCAB, tie=True)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_response_logits_equal_full_logits(world, model_dir):
    cases = [k for k, c in CASES.items() if c[0] == world]
    results = run_distributed(_body, world, model_dir, cases)
    mask = sample_batch(VOCAB).response_mask.bool()
    for case in cases:
        sp = CASES[case][4]
        for r in results:
            _check(case, r[case], mask, sp)


def _check(case, r, mask, sp):
    on, off = r["logp_True"], r["logp_False"]
    assert torch.allclose(on[mask], off[mask], rtol=0, atol=1e-5), f"{case}: response log-probs differ"
    assert torch.allclose(r["entropy_True"][mask], r["entropy_False"][mask], rtol=0, atol=1e-5), case
    assert bool(off[~mask].ne(0).any()), f"{case}: the full pass has prompt log-probs"
    if not sp:
        assert not on[~mask].any() and not r["entropy_True"][~mask].any(), f"{case}: values outside the response"
    if r["last"]:
        n = int(mask[:, 1:].sum())  # the first token of a row is predicted by nothing
        rows_on, rows_off = r["rows_True"], r["rows_False"]
        if sp:  # the output layer gathers the sequence over TP: no selection, full logits in both
            assert rows_on == rows_off
        else:
            assert all(s[0] == 1 for s in rows_on), f"{case}: selected logits are [1, n, V]: {rows_on}"
            assert sum(s[1] for s in rows_on) == n, f"{case}: {rows_on} logits rows for {n} response tokens"
            assert sum(s[0] * s[1] for s in rows_off) > n
    (m_on, w_on), (m_off, w_off) = r["steps"][True], r["steps"][False]
    assert m_on.keys() == m_off.keys()
    for k, v in m_off.items():
        assert m_on[k] == pytest.approx(v, rel=1e-4, abs=1e-6), f"{case}: {k} {m_on[k]} != {v}"
    assert m_on["actor/grad_norm"] > 0
    for name, w in w_off.items():
        assert torch.allclose(w_on[name], w, rtol=0, atol=1e-5), f"{case}: {name} differs after the step"


def test_no_selection_where_the_output_layer_gathers_the_sequence():
    def chunk(post, layer):
        return SimpleNamespace(module=SimpleNamespace(post_process=post, output_layer=layer))

    assert selects_rows(chunk(True, SimpleNamespace(sequence_parallel=False)))
    assert not selects_rows(chunk(True, SimpleNamespace(sequence_parallel=True)))  # input: this rank's slice
    assert not selects_rows(chunk(False, None))  # an earlier pipeline stage or virtual chunk
