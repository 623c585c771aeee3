"""The actor under context parallelism (parallel.cp = 2) equals one process on the same rows.

One launch per layout runs every check (process start dominates the cost): log-probs and entropy of
compute_logprobs, then a PACS v1, a GRPO, a GSPO and a PACS v2 step as the run's loss (with the entropy bonus,
so the gathered entropy's backward is exercised too), the weights exported after each. The rows have ragged
lengths, so the split pads. A second test runs PACS v2's hard reset on the full actor and on a LoRA one at
CP = 2 against one process (two launches). The GPU variant (NCCL, Transformer Engine's CP attention where it
imports) needs two GPUs: written, never run.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import (
    hf_config,
    make_qwen2,
    rel_update_diff,
    run_config,
    sample_batch,
    set_algorithm,
    valid_positions,
)
from _dist import run_distributed

from pacs_megatron.batch.rows import as_train_batch

VOCAB = 255
LOSSES = (("pacs", "pacs/loss"), ("grpo", "policy/loss"), ("gspo", "policy/loss"), ("pacs_v2", "pacs/loss"))
"""Trained in this order; "pacs_v2" is PACS anchored on the reference policy (the weights the actor started from)."""

# name -> (world size, tp, cp, pp)
LAYOUTS = {"cp2": (2, 1, 2, 1), "tp2cp2": (4, 2, 2, 1), "pp2cp2": (4, 1, 2, 2)}


def _export(actor) -> dict:
    return {n: t.detach().cpu().clone() for n, t in actor.export_hf_weights()}


def _cp_body(rank, world, model_dir, tp, cp, fused, dtype="float32", thd=False, pp=1):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir, tp=tp, pp=pp)
    cfg = replace(
        cfg,
        parallel=replace(cfg.parallel, cp=cp),
        model=replace(cfg.model, fused_lm_head="true" if fused else "false", dtype=dtype),
        # dynamic batching packs the micro-batches (THD) on CPU
        algorithm=replace(
            cfg.algorithm,
            entropy_coeff=0.01,
            dynamic_batching=thd,
            pacs=replace(cfg.algorithm.pacs, anchor="reference"),  # builds the reference policy (v2's anchor)
        ),
    )
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    actor = build_actor(cfg, groups, model_dir)
    batch = sample_batch(VOCAB)
    assert actor.thd == thd
    out = {"cp": (groups.cp_rank, groups.cp_size), "dp": groups.dp_size, "weights": [_export(actor)]}
    first = actor.compute_logprobs(batch, micro_batch_size=2, temperature=1.0, with_entropy=True)
    out["token_logp"], out["entropy"] = first.token_logp, first.entropy
    out["metrics"] = []
    actor.compute_ref_logprobs(batch, 2, 1.0)  # the reference is copied at its first use: the starting weights
    for name, _ in LOSSES:
        # the run's own loss (not train_step's loss_name): it carries the recipe's entropy term
        a = actor.sections.train.algorithm
        anchor = "reference" if name == "pacs_v2" else "old"
        a = replace(a, loss=name.removesuffix("_v2"), pacs=replace(a.pacs, anchor=anchor))
        set_algorithm(actor, a)
        old = actor.compute_logprobs(batch, micro_batch_size=2, temperature=1.0, with_entropy=True)
        ref = actor.compute_ref_logprobs(batch, 2, 1.0) if anchor == "reference" else None
        train = as_train_batch(batch, old.token_logp, old_entropy=old.entropy, ref_logp=ref)
        out["metrics"].append(actor.train_step(train))
        out["weights"].append(_export(actor))
    if rank:
        out.pop("weights")
    return out


def _v2_step(actor, batch) -> dict:
    """One PACS v2 step (anchored on the reference) with the log-probs the trainer's stages would give it."""
    old = actor.compute_logprobs(batch, micro_batch_size=2, temperature=1.0).token_logp
    ref = actor.compute_ref_logprobs(batch, 2, 1.0)
    return actor.train_step(as_train_batch(batch, old, ref_logp=ref))


def _reset_body(rank, world, model_dir, tp, cp):
    """PACS v2 with a hard reset, for the full actor and then a LoRA one (same process, same groups): a step, the
    reset, the log-probs of policy and reference after it, two more steps (the second anchored one update back);
    the exported weights after each (LoRA: merged) and LoRA's adapters."""
    from pacs_megatron.config import LoRAConfig
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir, tp=tp)
    pacs = replace(cfg.algorithm.pacs, anchor="reference")
    cfg = replace(cfg, parallel=replace(cfg.parallel, cp=cp), algorithm=replace(cfg.algorithm, loss="pacs", pacs=pacs))
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    b1, b2 = sample_batch(VOCAB, seed=1), sample_batch(VOCAB, seed=2)
    lora = replace(cfg, optimizer=replace(cfg.optimizer, lr=0.05), actor=replace(cfg.actor, lora=LoRAConfig(4, 8.0)))
    out = {}
    for name, c in (("full", cfg), ("lora", lora)):
        actor = build_actor(c, groups, model_dir)
        r: dict = {"weights": [], "adapters": [], "metrics": []}

        def snap(r=r, actor=actor, lora=name == "lora") -> None:
            r["weights"].append(_export(actor))
            r["adapters"].append(actor.peft_adapter()[0] if lora else {})

        snap()
        r["metrics"].append(_v2_step(actor, b1))
        snap()
        actor.reset_reference()
        r["policy"] = actor.compute_logprobs(b2, micro_batch_size=2, temperature=1.0).token_logp
        r["ref"] = actor.compute_ref_logprobs(b2, 2, 1.0)
        snap()
        for _ in range(2):
            r["metrics"].append(_v2_step(actor, b2))
            snap()
        out[name] = r
    return out


def test_thd_packing_for_cp_pads_each_row_and_splits_segment_by_segment():
    """cp = 2: every row's segment is a multiple of 4 tokens, targets never cross a row or enter padding,
    the ranks' local positions cover the packing once, and the unsplit of their concatenation is the identity."""
    from pacs_megatron.actor.thd import pack_thd

    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12], [13, 14, 0, 0, 0]])
    p = pack_thd(ids, torch.tensor([3, 5, 2]), multiple=8, cp=2)
    assert p.cu_seqlens.tolist() == [0, 4, 12, 16] and p.max_seqlen == 8
    assert p.input_ids.tolist() == [[5, 6, 7, 0, 8, 9, 10, 11, 12, 0, 0, 0, 13, 14, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    t = p.next_token_targets(-100)[0].tolist()
    assert t == [6, 7, -100, -100, 9, 10, 11, 12, -100, -100, -100, -100, 14, -100, -100, -100]
    # segment [0, 4): rank 0 holds 0 and 3, rank 1 holds 1 and 2; segment [4, 12): 4 5 10 11 / 6 7 8 9
    assert p.cp_local_index(0).tolist() == [0, 3, 4, 5, 10, 11, 12, 15]
    assert p.cp_local_index(1).tolist() == [1, 2, 6, 7, 8, 9, 13, 14]
    values = torch.arange(16.0)[None]
    gathered = torch.cat([values[:, p.cp_local_index(r)] for r in range(2)], dim=1)
    assert torch.equal(p.cp_unsplit(gathered), values)
    out = p.unpack_predictions(values)
    assert out.tolist() == [[0, 0, 1, 0, 0], [0, 4, 5, 6, 7], [0, 12, 0, 0, 0]]
    # cp = 1 packs as before: rows back to back
    q = pack_thd(ids, torch.tensor([3, 5, 2]), multiple=8)
    assert q.cu_seqlens.tolist() == [0, 3, 8, 10, 16]
    assert q.input_ids[0, :10].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen2(tmp_path_factory.mktemp("qwen2_cp") / "m", vocab=VOCAB, tie=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    return run_distributed(_cp_body, 1, model_dir, 1, 1, True)[0]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "fused", "thd"),
    [("cp2", True, False), ("cp2", False, False), ("cp2", True, True), ("tp2cp2", True, True), ("pp2cp2", True, True)],
)
def test_cp_matches_one_process(layout, fused, thd, reference, model_dir):
    """Against one process with padded micro-batches; ``thd``: packed micro-batches at CP = 2."""
    world, tp, cp, pp = LAYOUTS[layout]
    results = run_distributed(_cp_body, world, model_dir, tp, cp, fused, "float32", thd, pp)
    assert {r["cp"][1] for r in results} == {cp} and {r["cp"][0] for r in results} == set(range(cp))
    assert all(r["dp"] == 1 for r in results), "CP ranks must not count as data-parallel replicas"
    valid = valid_positions(sample_batch(VOCAB))
    for r in results:
        lp = float((r["token_logp"] - reference["token_logp"])[valid].abs().max())
        ent = float((r["entropy"] - reference["entropy"])[valid].abs().max())
        assert lp <= 1e-5 and ent <= 1e-5, f"{layout}: log-probs off by {lp:.2e}, entropy by {ent:.2e}"
        assert r["metrics"] == results[0]["metrics"], f"{layout}: metrics differ between ranks"
    head = results[0]
    # v1's r is 0 at pi_theta = pi_old; v2's anchor (the starting weights) is three updates behind
    r_abs = [m.get("pacs/implicit_reward_abs_mean") for m in reference["metrics"]]
    assert r_abs[0] == 0.0 and r_abs[3] > 1e-4, r_abs
    for i, (name, key) in enumerate(LOSSES):
        assert "actor/entropy_loss" in reference["metrics"][i], f"{name}: the entropy term is not in the loss"
        for k in (key, "actor/grad_norm", "actor/entropy_loss"):
            got, want = head["metrics"][i][k], reference["metrics"][i][k]
            assert got == pytest.approx(want, rel=1e-4, abs=1e-6), f"{layout} {name}: {k} {got} vs {want}"
        a0, a1 = reference["weights"][i], reference["weights"][i + 1]
        b0, b1 = head["weights"][i], head["weights"][i + 1]
        diff = rel_update_diff(a0, a1, b0, b1)
        assert diff <= 1e-4, f"{layout}: the {name} update differs from CP = 1 by {diff:.2e} (relative)"
    w = reference["weights"]
    moved = max(float((w[len(LOSSES)][k] - w[0][k]).abs().max()) for k in w[0])
    assert moved > 1e-4, "the steps did not change the weights"


@pytest.mark.distributed
def test_cp_resets_and_lora_match_one_process(model_dir):
    """PACS v2's hard reset and LoRA at CP = 2 against one process: the losses, the log-probs of policy and
    reference after the reset, each step's update of the weights and of LoRA's adapters."""
    one = run_distributed(_reset_body, 1, model_dir, 1, 1)[0]
    results = run_distributed(_reset_body, 2, model_dir, 1, 2)
    valid = valid_positions(sample_batch(VOCAB, seed=2))
    steps = ((0, 1), (2, 3), (3, 4))  # snapshots before and after each step; the reset is between 1 and 2
    for rank, r in enumerate(results):
        for name in ("full", "lora"):
            got, want, where = r[name], one[name], f"rank {rank} {name}"
            assert torch.equal(got["ref"], got["policy"]), f"{where}: after the reset the reference is not the policy"
            lp = float((got["policy"] - want["policy"])[valid].abs().max())
            assert lp <= 1e-5, f"{where}: log-probs after the reset off by {lp:.2e}"
            for i, m in enumerate(got["metrics"]):
                for k in ("pacs/loss", "actor/grad_norm", "pacs/implicit_reward_abs_mean"):
                    assert m[k] == pytest.approx(want["metrics"][i][k], rel=1e-4, abs=1e-6), f"{where} step {i}: {k}"
            for key in ("weights", "adapters") if name == "lora" else ("weights",):
                for i, j in steps:
                    diff = rel_update_diff(want[key][i], want[key][j], got[key][i], got[key][j])
                    assert diff <= 1e-4, f"{where}: the {key}' update {i}->{j} differs from CP = 1 by {diff:.2e}"
        full, adapters, want = r["full"]["weights"], r["lora"]["adapters"], one["lora"]["adapters"]
        assert all(torch.equal(full[1][k], full[2][k]) for k in full[1]), f"rank {rank}: the reset moved the policy"
        # the adapters start, and restart at the reset (B = 0, A redrawn from its seed), on the same bits
        for i in (0, 2):
            assert all(torch.equal(adapters[i][k], want[i][k]) for k in want[i]), f"rank {rank}: adapters {i} differ"
        assert not any(adapters[2][k].any() for k in adapters[2] if "lora_B" in k)
    # psi is 0 where the reference is the policy (the first step, the first after the reset), not one update on
    for name in ("full", "lora"):
        psi = [m["pacs/implicit_reward_abs_mean"] for m in one[name]["metrics"]]
        assert psi[0] == psi[1] == 0.0 and psi[2] > 1e-6, f"{name}: {psi}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CP = 2 on NCCL needs two GPUs")
def test_cp_on_two_gpus(model_dir):
    """Two GPUs, NCCL: Transformer Engine's p2p ring where TE imports, the all-gather attention otherwise."""
    one = run_distributed(_cp_body, 1, model_dir, 1, 1, False, "float32", gpu=True)[0]
    two = run_distributed(_cp_body, 2, model_dir, 1, 2, False, "float32", gpu=True)[0]
    valid = valid_positions(sample_batch(VOCAB))
    assert (two["token_logp"] - one["token_logp"])[valid].abs().max() <= 1e-3
    w1, w2 = one["weights"], two["weights"]
    for i in range(len(LOSSES)):
        assert rel_update_diff(w1[i], w1[i + 1], w2[i], w2[i + 1]) <= 1e-3
