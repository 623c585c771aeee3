"""The KL reference policy and the entropy bonus in the Megatron actor, against plain torch on HF transformers.

One launch per layout (single process, TP=2 with the reference offloaded to host, PP=2): the reference's
log-probs equal the actor's before any update and stay frozen after it; a GRPO and a PACS step with
``kl_loss_coef`` (k3) and ``entropy_coeff`` report the KL and entropy terms and the gradient norm that
plain torch computes from the full-vocabulary softmax of the same weights (transformers, float64);
TP=2 shards the vocabulary, so its entropy crosses ranks. A checkpoint round trip restores the
reference, not the trained weights. With both coefficients 0 nothing is built and no entropy asked for.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import hf_config, make_qwen2, run_config, sample_batch
from _dist import run_distributed

from pacs_megatron.batch.rows import as_train_batch
from pacs_megatron.pacs import PACSConfig, PolicyLossConfig, get_loss

VOCAB = 255  # TP=2 pads the vocabulary to 256
KL, ENT = 0.5, 0.1
LAYOUTS = {"single": (1, 1, 1, False), "tp2_offload": (2, 2, 1, True), "pp2": (2, 1, 2, False)}


def _export(actor) -> dict:
    return {n: t.detach().cpu().clone() for n, t in actor.export_hf_weights()}


def _config(model_dir, tp, pp, offload, loss, kl=KL, ent=ENT):
    cfg = run_config(model_dir, tp=tp, pp=pp)
    algo = replace(cfg.algorithm, loss=loss, kl_loss_coef=kl, kl_loss_type="k3", entropy_coeff=ent)
    return replace(cfg, algorithm=algo, actor=replace(cfg.actor, offload_reference=offload))


def _body(rank, world, model_dir, tp, pp, offload, ckpt_dir):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    out = {}
    groups = initialize_parallel(_config(model_dir, tp, pp, offload, "grpo").parallel, hf_config(model_dir))
    for loss in ("grpo", "pacs"):
        cfg = _config(model_dir, tp, pp, offload, loss)
        actor = build_actor(cfg, groups, model_dir)
        batch = sample_batch(VOCAB)
        old0 = actor.compute_logprobs(batch, 2, 1.0).token_logp
        ref0 = actor.compute_ref_logprobs(batch, 2, 1.0)
        resident = actor.reference.resident_bytes
        m1 = actor.train_step(as_train_batch(batch, old0, ref_logp=ref0))
        w1 = _export(actor)
        old1 = actor.compute_logprobs(batch, 2, 1.0).token_logp
        ref1 = actor.compute_ref_logprobs(batch, 2, 1.0)
        m2 = actor.train_step(as_train_batch(batch, old1, ref_logp=ref1))
        out[loss] = dict(m1=m1, m2=m2, old0=old0, old1=old1, ref1=ref1, resident=resident, w1=w1 if rank == 0 else None)
        out[loss]["frozen"] = torch.equal(ref0, old0) and torch.equal(ref1, ref0) and not torch.equal(old1, old0)
        if loss == "pacs":  # checkpoint: the reference comes back as saved, not as the trained policy
            actor.save_checkpoint(ckpt_dir, {"step": 2})
            fresh = build_actor(cfg, groups, model_dir)
            fresh.load_checkpoint(ckpt_dir)
            out["reloaded"] = torch.equal(fresh.compute_ref_logprobs(batch, 2, 1.0), ref0)
    return out


def _torch_reference(model_dir, w1, batch, old1, ref, loss_name):
    """Plain torch, float64: HF model at the weights after step 1, full-vocabulary log-softmax and entropy,
    the registered loss + KL * token-mean k3 - ENT * token-mean entropy (GRPO: token-mean; PACS: row means)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    missing, unexpected = model.load_state_dict({k: v.double() for k, v in w1.items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied: the head is the embedding
    ids, mask = batch.input_ids, batch.response_mask
    logits = model(input_ids=ids).logits[:, :-1]
    logp_all = torch.log_softmax(logits, -1)
    logp = torch.nn.functional.pad(logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    entropy = torch.nn.functional.pad(-(logp_all.exp() * logp_all).sum(-1), (1, 0))
    d = ref.double() - logp
    k3 = torch.exp(d) - d - 1
    m = mask.double()
    if loss_name == "grpo":
        base, _ = get_loss("grpo").fn(
            as_train_batch(batch, old1.double()), logp, PolicyLossConfig(adv_estimator="grpo")
        )
        kl, ent = (k3 * m).sum() / m.sum(), (entropy * m).sum() / m.sum()
    else:
        base, _ = get_loss("pacs").fn(as_train_batch(batch, old1.double()), logp, PACSConfig())
        kl = ((k3 * m).sum(1) / m.sum(1)).mean()
        ent = ((entropy * m).sum(1) / m.sum(1)).mean()
    total = base + KL * kl - ENT * ent
    total.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(kl.detach()), float(ent.detach()), float(norm)


def _off_body(rank, world, model_dir):
    import pacs_megatron.actor.train_step as ts
    from pacs_megatron.batch.rows import TrainBatch
    from pacs_megatron.loop import update_stages
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    asked = []
    real = ts.token_logprobs
    ts.token_logprobs = lambda *a, **kw: asked.append(kw.get("with_entropy")) or real(*a, **kw)
    cfg = _config(model_dir, 1, 1, False, "grpo", kl=0.0, ent=0.0)
    # every row's old log-probs from the no-grad pass (none from a training forward, which asks for entropy)
    cfg = replace(cfg, algorithm=replace(cfg.algorithm, old_logp_from_forward=False))
    actor = build_actor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir)), model_dir)
    rows, old, _ = update_stages.prepare_local_batch(cfg, actor, sample_batch(VOCAB), 0, 1)
    assert old.first == 0
    local = TrainBatch.of_rows(rows, old_logp=old.logp, old_entropy=old.entropy)
    actor.train_step(local)
    return dict(reference=actor.reference, ref_logp=local.ref_logp, asked=asked)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen2(tmp_path_factory.mktemp("qwen2_ref") / "m", vocab=VOCAB, tie=True)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kl_and_entropy_match_plain_torch(layout, model_dir, tmp_path):
    world, tp, pp, offload = LAYOUTS[layout]
    results = run_distributed(_body, world, model_dir, tp, pp, offload, str(tmp_path / "ckpt"))
    head = results[0]
    batch = sample_batch(VOCAB)
    for r in results:
        assert r["reloaded"], f"{layout}: the checkpoint did not restore the reference"
        for loss in ("grpo", "pacs"):
            assert r[loss]["frozen"], f"{layout}: reference != actor before the update, or it moved"
            assert r[loss]["m2"] == head[loss]["m2"], "metrics differ between ranks"
            assert (r[loss]["resident"] == 0) == offload
    for loss in ("grpo", "pacs"):
        h = head[loss]
        assert h["m1"]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-12)  # policy == reference at step 1
        kl, ent, norm = _torch_reference(model_dir, h["w1"], batch, h["old1"], h["ref1"], loss)
        assert kl > 1e-6 and h["m2"]["actor/kl_loss"] == pytest.approx(kl, rel=1e-4)
        assert h["m2"]["actor/entropy_loss"] == pytest.approx(ent, rel=1e-5)
        assert h["m2"]["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)


@pytest.mark.distributed
def test_switched_off_builds_and_computes_nothing(model_dir):
    """kl_loss_coef = entropy_coeff = 0: no reference model, no reference pass, no entropy in the training
    forward; the memory plan counts no reference (and counts one with the switch on)."""
    r = run_distributed(_off_body, 1, model_dir)[0]
    assert r["reference"] is None and r["ref_logp"] is None and r["asked"] and not any(r["asked"])

    from pacs_megatron.launch.memory_plan import estimate_run

    off = _config(model_dir, 1, 1, False, "grpo", kl=0.0, ent=0.0)
    on = _config(model_dir, 1, 1, False, "grpo")
    hf = hf_config(model_dir)
    assert estimate_run(off, hf, 80.0).reference_gib == 0.0
    plan = estimate_run(on, hf, 80.0)
    assert plan.reference_gib == plan.params_gib > 0
    assert plan.train_gib == pytest.approx(estimate_run(off, hf, 80.0).train_gib + plan.params_gib)
    offloaded = replace(on, actor=replace(on.actor, offload_reference=True))
    assert estimate_run(offloaded, hf, 80.0).reference_gib == 0.0
