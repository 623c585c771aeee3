"""Resume with megatron's distributed optimizer (DP=2 gloo ranks, torch's Adam: no Apex / TE) is exact.

megatron-core 0.16.1's ``DistributedOptimizer`` assumes Apex's / TE's FusedAdam (a step per param group)
where this machine has torch's Adam (a step per parameter); actor/optimizer.py bridges the gaps. One launch:

* actor A trains steps 1-2, saves, trains step 3; actor B, fresh (its Adam never stepped), loads the
  checkpoint and trains step 3: the same loss, metrics, weights and Adam state, bit for bit (fp32). A's save itself runs
  before B's load on purpose: before the fix B's load died in megatron (``assert len(steps) == 1`` in
  ``DistributedOptimizer.state_dict``; then ``KeyError: 'step'`` in ``_set_main_param_and_optimizer_states``),
  and a load that shared one step tensor among all parameters drifted at step 3 (its Adam counted one
  step per parameter);
* PACS v2: A resets the reference after step 3 (the optimizer re-initialised: step 0, zero moments), saves,
  trains step 4; actor C, fresh, loads that checkpoint (reference included) and trains step 4: bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import hf_config, make_qwen2, run_config, sample_batch
from _dist import run_distributed

from pacs_megatron.batch.rows import as_train_batch

VOCAB = 255


def _config(model_dir):
    # warm-up + cosine: the resumed steps must continue the schedule; anchor=reference: v2's reset
    cfg = run_config(model_dir, dp=2, use_distributed_optimizer="true", lr_warmup_steps=1, lr_decay_style="cosine")
    algo = replace(cfg.algorithm, pacs=replace(cfg.algorithm.pacs, anchor="reference"), reference_reset_every=1)
    return replace(cfg, algorithm=algo, trainer=replace(cfg.trainer, total_steps=8))


def _step(actor, batch) -> dict:
    old = actor.compute_logprobs(batch, 2, 1.0).token_logp
    return actor.train_step(as_train_batch(batch, old, ref_logp=actor.compute_ref_logprobs(batch, 2, 1.0)))


def _snapshot(actor) -> dict:
    """The HF weights and this rank's Adam state (its shard of the moments, and every parameter's step)."""
    out = {f"w/{n}": t.detach().clone() for n, t in actor.export_hf_weights()}
    for i, opt in enumerate(actor.optimizer.chained_optimizers):
        for j, state in enumerate(opt.optimizer.state.values()):
            out.update({f"adam/{i}/{j}/{k}": v.detach().clone() for k, v in state.items()})
    return out


def _body(rank, world, model_dir, ckpt_dir):
    from pacs_megatron.batch.build import dp_shard
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = _config(model_dir)
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    batches = [dp_shard(sample_batch(VOCAB, seed=s), groups.dp_rank, groups.dp_size) for s in range(1, 5)]
    a = build_actor(cfg, groups, model_dir)
    assert a.distributed_optimizer
    for b in batches[:2]:
        _step(a, b)
    a.save_checkpoint(f"{ckpt_dir}/step2", {"step": 2})
    ma = [_step(a, batches[2])]
    sa = _snapshot(a)
    a.reset_reference()
    a.save_checkpoint(f"{ckpt_dir}/reset", {"step": 3})
    ma.append(_step(a, batches[3]))
    sa_reset = _snapshot(a)

    b = build_actor(cfg, groups, model_dir)
    b.load_checkpoint(f"{ckpt_dir}/step2")
    mb = _step(b, batches[2])
    sb = _snapshot(b)
    c = build_actor(cfg, groups, model_dir)
    c.load_checkpoint(f"{ckpt_dir}/reset")
    mc = _step(c, batches[3])
    sc = _snapshot(c)
    return {
        "ma": ma,
        "mb": mb,
        "mc": mc,
        "diff_b": sorted(k for k in sa if k not in sb or not torch.equal(sa[k], sb[k])),
        "diff_c": sorted(k for k in sa_reset if k not in sc or not torch.equal(sa_reset[k], sc[k])),
        "steps": sorted({float(v) for k, v in sb.items() if k.endswith("/step")}),
    }


@pytest.mark.distributed
def test_distributed_optimizer_resume_is_exact(tmp_path):
    model_dir = make_qwen2(tmp_path / "m", vocab=VOCAB, layers=2)
    for r in run_distributed(_body, 2, model_dir, str(tmp_path / "ckpt")):
        assert r["mb"] == r["ma"][0], "step 3 after a resume differs from the uninterrupted run"
        assert not r["diff_b"], f"weights / Adam state differ after the resume: {r['diff_b'][:5]}"
        assert r["steps"] == [3.0], f"every parameter's Adam step must be 3, found {r['steps']}"
        assert r["mc"] == r["ma"][1], "the step after a v2 reset differs once resumed from the reset's checkpoint"
        assert not r["diff_c"], f"weights / Adam state differ after resuming at a reset: {r['diff_c'][:5]}"
