"""Dynamic (token-budget) micro-batches give the fixed-batching update, at TP=2, PP=2 and DP=2 over gloo.

One launch per layout builds two actors from the same weights, one per batching mode, and runs on
the same DP-balanced local rows: old log-probs for two mini-batches at once (planned per mini-batch),
then a PACS step on mini-batch 0, a GRPO step on mini-batch 1 (rows and tokens as loss units) and a
GRPO step with Dr.GRPO's ``seq-mean-token-sum-norm`` and no ``loss_agg_horizon`` on mini-batch 0 (H is
then rollout.max_response_length, which the token-budget micro-batches must not change).
Checked: the dynamic micro-batches really differ in shape, log-probs equal fixed batching's, the
first training forward reproduces the old log-probs bit for bit (batch invariance), and metrics and
weight updates match fixed batching within float tolerance.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import (
    GROUP,
    hf_config,
    make_qwen2,
    rel_update_diff,
    run_config,
    sample_batch,
    set_algorithm,
    valid_positions,
)
from _dist import run_distributed

from pacs_megatron.batch.build import split_mini_batches
from pacs_megatron.batch.rows import as_train_batch

VOCAB = 255
GROUPS, MINI = 8, 4  # 8 prompt groups per step, 2 mini-batches of 4
BUDGET = 40  # rows x padded length: 2 rows of 16 or 4 rows of 8 per micro-batch

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}  # name -> (tp, pp), 2 ranks each


def _config(model_dir, tp, pp, dp, dynamic):
    cfg = run_config(model_dir, tp=tp, pp=pp, dp=dp)
    return replace(
        cfg,
        data=replace(cfg.data, max_prompt_length=8),
        rollout=replace(cfg.rollout, max_response_length=8),
        trainer=replace(cfg.trainer, train_batch_size=GROUPS),
        algorithm=replace(
            cfg.algorithm, mini_batch_size=MINI, dynamic_batching=dynamic, max_tokens_per_micro_batch=BUDGET
        ),
    )


def _body(rank, world, model_dir, tp, pp):
    from pacs_megatron.batch.build import split_mini_batches
    from pacs_megatron.batch.packing import dp_balanced_shard
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    dp = world // (tp * pp)
    groups = initialize_parallel(_config(model_dir, tp, pp, dp, True).parallel, hf_config(model_dir))
    local = dp_balanced_shard(sample_batch(VOCAB, groups=GROUPS), groups.dp_rank, dp, MINI)
    out = {"group_ids": local.group_ids}
    for mode in ("fixed", "dynamic"):
        actor = build_actor(_config(model_dir, tp, pp, dp, mode == "dynamic"), groups, model_dir)
        w0 = {n: t.clone() for n, t in actor.export_hf_weights()}
        old = actor.compute_logprobs(local, micro_batch_size=GROUP, temperature=1.0, mini_batch_groups=MINI // dp)
        minis = split_mini_batches(as_train_batch(local, old.token_logp), MINI // dp)
        m_pacs = actor.train_step(minis[0])
        m_grpo = actor.train_step(minis[1], loss_name="grpo")
        w2 = {n: t.clone() for n, t in actor.export_hf_weights()}
        algorithm = actor.sections.train.algorithm
        policy = replace(algorithm.policy, loss_agg_mode="seq-mean-token-sum-norm", loss_agg_horizon=0)
        set_algorithm(actor, replace(algorithm, policy=policy))
        m_norm = actor.train_step(minis[0], loss_name="grpo")
        w3 = {n: t.clone() for n, t in actor.export_hf_weights()}
        out[mode] = {"logp": old.token_logp, "m_pacs": m_pacs, "m_grpo": m_grpo, "m_norm": m_norm}
        if rank == 0:
            out[mode].update(w0=w0, w2=w2, w3=w3)
        if mode == "dynamic":
            packed = actor._packed(minis[0], 0)[0]
            out["shapes"] = {tuple(m.input_ids.shape) for m in packed}
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen2(tmp_path_factory.mktemp("qwen2_packing") / "m", vocab=VOCAB, tie=True)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dynamic_batching_matches_fixed(layout, model_dir):
    tp, pp = LAYOUTS[layout]
    results = run_distributed(_body, 2, model_dir, tp, pp)
    head = results[0]
    assert len(head["shapes"]) > 1, "the test needs micro-batches of different shapes"
    batch = sample_batch(VOCAB, groups=GROUPS)
    valid = valid_positions(batch)
    for r in results:
        rows = torch.cat([torch.arange(g * GROUP, (g + 1) * GROUP) for g in r["group_ids"][::GROUP].tolist()])
        ok = valid[rows]
        fixed, dyn = r["fixed"], r["dynamic"]
        assert (fixed["logp"] - dyn["logp"])[ok].abs().max() <= 1e-6
        # batch invariance: old-log-prob pass and first training forward share micro-batches and shapes
        assert dyn["m_pacs"]["actor/max_abs_logratio"] == 0.0
        assert r["dynamic"]["m_pacs"] == head["dynamic"]["m_pacs"], "metrics differ between ranks"
    f, d = head["fixed"], head["dynamic"]
    for key in ("pacs/loss", "actor/grad_norm"):
        assert d["m_pacs"][key] == pytest.approx(f["m_pacs"][key], rel=1e-5)
    for key in ("policy/loss", "actor/grad_norm"):
        assert d["m_grpo"][key] == pytest.approx(f["m_grpo"][key], rel=1e-4, abs=1e-7)
    assert rel_update_diff(f["w0"], f["w2"], d["w0"], d["w2"]) <= 1e-5, f"{layout}: updates differ"
    # seq-mean-token-sum-norm without a horizon divides by the step's padded length in both modes
    for key in ("policy/loss", "actor/grad_norm"):
        assert d["m_norm"][key] == pytest.approx(f["m_norm"][key], rel=1e-4, abs=1e-7), key
    assert rel_update_diff(f["w2"], f["w3"], d["w2"], d["w3"]) <= 1e-4, f"{layout}: seq-mean-token-sum-norm differs"


def test_thd_pack_unpack_round_trip():
    """The THD bookkeeping: packed tokens, restarting positions, boundaries, next-token targets that
    never cross a row, and packed predictions scattered back to the padded layout with gradients."""
    from pacs_megatron.actor.thd import pack_thd

    batch = sample_batch(VOCAB, groups=3)
    b, T = batch.input_ids.shape
    p = pack_thd(batch.input_ids, batch.seq_lens, multiple=16)
    real = int(batch.seq_lens.sum())
    assert p.input_ids.shape[1] % 16 == 0 and p.input_ids.shape[1] - real < 16
    assert p.cu_seqlens[: b + 1].tolist() == [0, *torch.cumsum(batch.seq_lens, 0).tolist()]
    valid = torch.arange(T)[None] < batch.seq_lens[:, None]
    assert torch.equal(p.input_ids[0, :real], batch.input_ids[valid])
    assert torch.equal(p.position_ids[0, :real], torch.arange(T).expand(b, T)[valid])
    targets = p.next_token_targets(-100)
    predicted = torch.arange(T)[None].expand(b, T)[valid] + 1 < batch.seq_lens.repeat_interleave(batch.seq_lens)
    assert torch.equal(targets[0, :real][predicted], batch.input_ids[:, 1:][valid[:, 1:]])
    assert targets[0, :real][~predicted].eq(-100).all() and targets[0, real:].eq(-100).all()
    values = torch.randn(1, p.input_ids.shape[1], requires_grad=True)
    out = p.unpack_predictions(values)  # column t: the prediction of token t (from position t - 1)
    shifted = torch.nn.functional.pad(valid[:, 1:] & valid[:, :-1], (1, 0))
    assert torch.equal(out[shifted], values[0, :real][predicted]) and not out[:, 0].any()
    out.sum().backward()
    assert values.grad[0, :real].eq(predicted.float()).all() and values.grad[0, real:].eq(0).all()


def _thd_body(rank, world, model_dir):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = _config(model_dir, 1, 1, 1, True)
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    batch = sample_batch(VOCAB, groups=GROUPS)
    out = {}
    for thd in (True, False):
        actor = build_actor(cfg, groups, model_dir)
        out["thd_default"] = out.get("thd_default", actor.thd)
        actor.thd = thd
        res = actor.compute_logprobs(batch, micro_batch_size=GROUP, temperature=1.0, with_entropy=True)
        metrics = actor.train_step(split_mini_batches(as_train_batch(batch, res.token_logp), MINI)[0])
        out[thd] = {"logp": res.token_logp, "entropy": res.entropy, "metrics": metrics}
        out[thd]["weights"] = {n: t.clone() for n, t in actor.export_hf_weights()}
    return out


@pytest.mark.distributed
def test_thd_matches_padded(model_dir):
    """THD-packed micro-batches (the CPU default with dynamic batching: SDPA core attention; on GPU
    Transformer Engine's) give the padded path's log-probs, entropy, loss and update."""
    r = run_distributed(_thd_body, 1, model_dir)[0]
    valid = valid_positions(sample_batch(VOCAB, groups=GROUPS))
    assert r["thd_default"], "dynamic batching on CPU packs THD"
    thd, pad = r[True], r[False]
    assert (thd["logp"] - pad["logp"])[valid].abs().max() <= 1e-5
    assert (thd["entropy"] - pad["entropy"])[valid].abs().max() <= 1e-5
    assert thd["metrics"]["actor/max_abs_logratio"] == 0.0  # old-log-prob pass and training forward agree
    for key in ("pacs/loss", "actor/grad_norm"):
        assert thd["metrics"][key] == pytest.approx(pad["metrics"][key], rel=1e-5)
    for name, w in pad["weights"].items():
        torch.testing.assert_close(thd["weights"][name], w, rtol=0, atol=1e-5)
