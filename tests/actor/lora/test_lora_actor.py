"""The Megatron actor with LoRA (``actor.lora.rank`` > 0), at TP = 2 on two gloo ranks.

PACS v2's anchor on, so the reference policy is the LoRA one (actor/lora/reference.py). Checked: only the
adapters are trainable; at step 0 the actor's log-probs equal the plain actor's bit for bit (B = 0) and so do
the reference's (adapters off); two updates change the adapters and leave every base weight as loaded; the
exported (merged) weights, loaded by transformers, give the actor's log-probs, which is what a merged weight
sync sends; the factors both TP ranks hold whole stay equal (their gradients are summed over TP); the
reference stays the base; `pacs-megatron export` of a checkpoint writes a PEFT adapter that PEFT puts on the HF
base with the actor's log-probs (within 1e-5, fp32); a v2 reset merges the adapters (the policy is unchanged, the
reference becomes it, B = 0 again); a checkpoint round trip restores adapters and merged base. A second
launch at TP=1 x PP=2 makes the same update (the adapters are seeded by global layer number, not by rank).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _dist import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/actor/_actor_helpers.py
from _actor_helpers import (
    causal_logprobs,
    hf_config,
    hf_logprobs,
    make_qwen2,
    rel_update_diff,
    run_config,
    sample_batch,
    valid_positions,
)

from pacs_megatron.batch.rows import as_train_batch
from pacs_megatron.config import ConfigError, LoRAConfig, load_config

VOCAB = 255


def _cfg(model_dir, rank, tp=2, pp=1):
    cfg = run_config(model_dir, tp=tp, pp=pp, lr=0.05)
    algo = replace(cfg.algorithm, pacs=replace(cfg.algorithm.pacs, anchor="reference"))
    return replace(cfg, algorithm=algo, actor=replace(cfg.actor, lora=LoRAConfig(rank=rank, alpha=8.0)))


def _state(actor):
    from pacs_megatron.actor.weights import unwrap

    return {n: p.detach().clone() for c in actor.model for n, p in unwrap(c).named_parameters()}


def _body(rank, world, model_dir, out_dir, ckpt_dir):
    from omegaconf import OmegaConf

    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel
    from pacs_megatron.run.layout import StepLayout

    groups = initialize_parallel(_cfg(model_dir, 4).parallel, hf_config(model_dir))
    batch = sample_batch(VOCAB)
    plain = build_actor(_cfg(model_dir, 0), groups, model_dir).compute_logprobs(batch, 4, 1.0).token_logp
    actor = build_actor(_cfg(model_dir, 4), groups, model_dir)
    s0 = _state(actor)
    lora_numel = sum(t.numel() for n, t in s0.items() if ".lora_" in n)
    old0 = actor.compute_logprobs(batch, 4, 1.0).token_logp
    ref0 = actor.compute_ref_logprobs(batch, 4, 1.0)
    for _ in range(2):
        old = actor.compute_logprobs(batch, 4, 1.0).token_logp
        m = actor.train_step(as_train_batch(batch, old, ref_logp=actor.compute_ref_logprobs(batch, 4, 1.0)))
    s2 = _state(actor)
    trained = actor.compute_logprobs(batch, 4, 1.0).token_logp
    ref2 = actor.compute_ref_logprobs(batch, 4, 1.0)
    actor.save_hf(out_dir)  # the merged weights, as the weight sync exports them
    config = OmegaConf.to_container(OmegaConf.structured(_cfg(model_dir, 4)))
    step_dir = StepLayout(Path(ckpt_dir) / "step_00000002")
    extra = {"step": 2, "config": config, "dataset": {}}
    actor.save_checkpoint(str(step_dir.path), extra)  # for `export`: a PEFT adapter
    if rank == 0:
        step_dir.marker.write_text("")  # complete, as the run's checkpoint manager marks it
    actor.reset_reference()
    after_reset = actor.compute_logprobs(batch, 4, 1.0).token_logp
    ref_reset = actor.compute_ref_logprobs(batch, 4, 1.0)
    s_reset = _state(actor)
    actor.save_checkpoint(f"{ckpt_dir}/reset", {"step": 3})
    actor.train_step(as_train_batch(batch, after_reset, ref_logp=ref_reset))
    actor.load_checkpoint(f"{ckpt_dir}/reset")
    s_loaded = _state(actor)
    return {
        "trainable": actor.trainable_params,
        "lora_numel": lora_numel,
        "plain": plain,
        "old0": old0,
        "ref0": ref0,
        "grad_norm": m["actor/grad_norm"],
        "trained": trained,
        "ref2": ref2,
        "after_reset": after_reset,
        "ref_reset": ref_reset,
        "base_frozen": all(torch.equal(s0[n], s2[n]) for n in s0 if ".lora_" not in n),
        "b_moved": all(not torch.equal(s0[n], s2[n]) for n in s0 if n.endswith(".lora_b")),
        "b_zero_after_reset": all(not s_reset[n].any() for n in s_reset if n.endswith(".lora_b")),
        "restored": all(torch.equal(s_reset[n], s_loaded[n]) for n in s_reset),
        # the factors every TP rank holds whole: equal on both ranks only if their gradients were summed
        "replicated": {
            n: t for n, t in s2.items() if n.endswith(("qkv.lora_a", "fc1.lora_a", "proj.lora_b", "fc2.lora_b"))
        },
    }


def _pp_body(rank, world, model_dir):
    """The same two updates at TP=1 x PP=2: the merged weights every rank exports."""
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = _cfg(model_dir, 4, tp=1, pp=2)
    actor = build_actor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir)), model_dir)
    batch = sample_batch(VOCAB)
    for _ in range(2):
        old = actor.compute_logprobs(batch, 4, 1.0).token_logp
        actor.train_step(as_train_batch(batch, old, ref_logp=actor.compute_ref_logprobs(batch, 4, 1.0)))
    merged = {n: t.detach().clone() for n, t in actor.export_hf_weights()}  # collective: every rank iterates
    return merged if rank == 0 else None


def _peft_logprobs(model_dir, adapter_dir, input_ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return causal_logprobs(PeftModel.from_pretrained(base, adapter_dir), input_ids)


@pytest.mark.distributed
def test_lora_actor_trains_adapters_syncs_merged_and_resets(tmp_path):
    model_dir = make_qwen2(tmp_path / "m", vocab=VOCAB)
    out_dir = tmp_path / "merged"
    results = run_distributed(_body, 2, model_dir, str(out_dir), str(tmp_path / "ckpt"))
    # `pacs-megatron export` of the LoRA checkpoint: a PEFT adapter that PEFT puts on the HF base
    adapter = tmp_path / "adapter"
    cmd = [sys.executable, "-m", "pacs_megatron", "export", str(tmp_path / "ckpt" / "step_00000002"), str(adapter)]
    res = subprocess.run([*cmd, "--model-dir", model_dir], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    # issue 58: the base by absolute path, and the dtype the adapter was trained on it in
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        Path(model_dir).resolve()
    )
    assert json.loads((adapter / "pacs_export.json").read_text())["base_dtype"] == "float32"
    assert "the adapter was trained on" in res.stderr
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    batch = sample_batch(VOCAB)
    valid = valid_positions(batch)
    rep0, rep1 = results[0]["replicated"], results[1]["replicated"]
    assert len(rep0) == 16 and all(torch.equal(rep0[n], rep1[n]) for n in rep0)  # 4 layers x 4 linears
    for r in results:
        assert r["trainable"] == r["lora_numel"] > 0  # the adapters and nothing else reach the optimizer
        assert torch.equal(r["old0"], r["plain"]) and torch.equal(r["ref0"], r["old0"])  # B = 0: the base
        assert r["grad_norm"] > 0 and r["base_frozen"] and r["b_moved"]
        assert not torch.equal(r["trained"], r["old0"])
        assert torch.equal(r["ref2"], r["ref0"])  # the reference is the frozen base, adapters off
        hf = hf_logprobs(str(out_dir), batch.input_ids)
        assert (hf - r["trained"])[valid].abs().max() < 1e-4  # merged export == the policy
        peft = _peft_logprobs(model_dir, str(adapter), batch.input_ids)
        assert (peft - r["trained"])[valid].abs().max() < 1e-5  # the PEFT adapter on the HF base == the policy
        # a reset: the policy is unchanged (up to the merge's rounding) and the reference becomes it
        assert (r["after_reset"] - r["trained"])[valid].abs().max() < 1e-4
        assert torch.equal(r["ref_reset"], r["after_reset"]) and r["b_zero_after_reset"]
        assert r["restored"]  # adapters and merged base come back from the checkpoint
    # another layout, TP=1 x PP=2: the adapters are seeded by global layer, so the same updates come out
    from safetensors.torch import load_file

    base, tp2 = load_file(f"{model_dir}/model.safetensors"), load_file(str(out_dir / "model.safetensors"))
    pp2 = run_distributed(_pp_body, 2, model_dir)[0]
    # (it caught the sharded factors counted as TP duplicates: the clipped gradient norm missed rank 1's shards)
    assert rel_update_diff(base, tp2, base, pp2) < 1e-3


def test_bad_lora_settings_get_one_line():
    with pytest.raises(ConfigError, match=r"actor.lora.targets=\['linear_q'\]: choose from"):
        load_config(None, ["actor.lora.rank=4", "actor.lora.targets=[linear_q]"])
    with pytest.raises(ConfigError, match="actor.lora.rank=-1 must be >= 0"):
        load_config(None, ["actor.lora.rank=-1"])
    with pytest.raises(ConfigError, match="sequence parallelism"):
        load_config(None, ["actor.lora.rank=4", "parallel.tp=2", "parallel.sequence_parallel=true"])
