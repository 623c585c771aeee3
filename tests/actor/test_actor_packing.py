"""Dynamic (token-budget) micro-batches give the fixed-batching update, at TP=2, PP=2 and DP=2 over gloo.

One launch per layout builds two actors from the same weights, one per batching mode, and runs on
the same DP-balanced local rows: old log-probs for two mini-batches at once (planned per mini-batch),
then a PACS step on mini-batch 0 and a GRPO step on mini-batch 1 (rows and tokens as loss units).
Checked: the dynamic micro-batches really differ in shape, log-probs equal fixed batching's, the
first training forward reproduces the old log-probs bit for bit (batch invariance), and metrics and
weight updates match fixed batching within float tolerance.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import GROUP, hf_config, make_qwen2, rel_update_diff, run_config, sample_batch, valid_positions
from _dist import run_distributed

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
    from pacs_megatron.actor import MegatronActor
    from pacs_megatron.data.batching import split_mini_batches
    from pacs_megatron.data.packing import dp_balanced_shard
    from pacs_megatron.parallel import initialize_parallel

    dp = world // (tp * pp)
    groups = initialize_parallel(_config(model_dir, tp, pp, dp, True).parallel, hf_config(model_dir))
    local = dp_balanced_shard(sample_batch(VOCAB, groups=GROUPS), groups.dp_rank, dp, MINI)
    out = {"group_ids": local.group_ids}
    for mode in ("fixed", "dynamic"):
        actor = MegatronActor(_config(model_dir, tp, pp, dp, mode == "dynamic"), groups, model_dir)
        w0 = {n: t.clone() for n, t in actor.export_hf_weights()}
        old = actor.compute_logprobs(local, micro_batch_size=GROUP, temperature=1.0, mini_batch_groups=MINI // dp)
        minis = split_mini_batches(local.with_(old_logp=old.token_logp), MINI // dp)
        m_pacs = actor.train_step(minis[0])
        m_grpo = actor.train_step(minis[1], loss_name="grpo")
        w2 = {n: t.clone() for n, t in actor.export_hf_weights()}
        out[mode] = {"logp": old.token_logp, "m_pacs": m_pacs, "m_grpo": m_grpo}
        if rank == 0:
            out[mode].update(w0=w0, w2=w2)
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


def test_thd_pack_unpack_round_trip():
    """The bookkeeping of the (GPU-only) THD path: packed tokens, restarting positions, boundaries, and
    logits scattered back to the padded layout with gradients."""
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
    logits = torch.randn(1, p.input_ids.shape[1], 5, requires_grad=True)
    out = p.unpack(logits)
    assert torch.equal(out[valid], logits[0, :real]) and not out[~valid].any()
    out.sum().backward()
    assert logits.grad[0, :real].eq(1).all() and logits.grad[0, real:].eq(0).all()


def _thd_body(rank, world, model_dir):
    from pacs_megatron.actor import MegatronActor
    from pacs_megatron.parallel import initialize_parallel

    cfg = _config(model_dir, 1, 1, 1, True)
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    actor = MegatronActor(cfg, groups, model_dir)
    batch = sample_batch(VOCAB, groups=GROUPS)
    out = {"thd": actor.thd}
    for thd in (True, False):
        actor.thd = thd
        out[thd] = actor.compute_logprobs(batch, micro_batch_size=GROUP, temperature=1.0).token_logp
    return out


@pytest.mark.gpu
def test_thd_matches_padded_on_gpu(model_dir):
    """Never run here (no GPU, no Transformer Engine): THD-packed log-probs equal the padded path's."""
    from pacs_megatron.actor.model import have_transformer_engine

    if not torch.cuda.is_available() or not have_transformer_engine():
        pytest.skip("needs a GPU and Transformer Engine")
    r = run_distributed(_thd_body, 1, model_dir, gpu=True)[0]
    valid = valid_positions(sample_batch(VOCAB, groups=GROUPS))
    assert r["thd"] and (r[True] - r[False])[valid].abs().max() <= 1e-3
