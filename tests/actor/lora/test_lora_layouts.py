"""LoRA at the layouts tests/actor/lora/test_lora_actor.py does not launch: PP=2 x VPP=2 (the interleaved schedule, an
adapter per virtual stage) and EP=2 (a Qwen3-MoE whose experts are split over two ranks, drawn from DP), each
against DP=2 on the same weights and rows (every DP rank holds the whole batch, so its mean gradient is one
replica's). On the MoE model the adapters sit on attention (linear_qkv, linear_proj): the experts' linears are not
adapted (actor/lora/adapters.py) and stay frozen with the router. One 2-rank launch builds the layouts in turn.

Checked per layout: only the adapters are trainable; two PACS v2 updates (reference anchor) move the merged
weights as the DP=2 run does (relative update difference < 1e-3, as the TP/PP comparison of test_lora_actor.py);
the reference (adapters off) after them is the step-0 policy bit for bit.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _dist import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/actor/_actor_helpers.py
from _actor_helpers import GROUP, hf_config, make_qwen3, rel_update_diff, run_config, sample_batch

from pacs_megatron.batch.rows import as_train_batch
from pacs_megatron.config import LoRAConfig

VOCAB = 64
LAYOUTS = {"dp": (1, 1, 1, 2, 1), "vpp": (1, 2, 2, 1, 1), "ep": (1, 1, 1, 2, 2)}
"""name -> (tp, pp, vpp, dp, ep)"""
pytestmark = pytest.mark.distributed


def _actor(model_dir, layout):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    tp, pp, vpp, dp, ep = LAYOUTS[layout]
    cfg = run_config(model_dir, tp=tp, pp=pp, dp=dp, vpp=vpp, lr=0.05)
    cfg = replace(
        cfg,
        parallel=replace(cfg.parallel, ep=ep),
        algorithm=replace(
            cfg.algorithm,
            pacs=replace(cfg.algorithm.pacs, anchor="reference"),
            micro_batch_size=GROUP,  # 4 micro-batches: the interleaved schedule needs a multiple of PP
        ),
        actor=replace(cfg.actor, lora=LoRAConfig(rank=4, alpha=8.0, targets=("linear_qkv", "linear_proj"))),
    )
    return build_actor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir)), model_dir)


def _body(rank, world, model_dir):
    from pacs_megatron.actor.weights import unwrap

    batch = sample_batch(VOCAB)
    out = {}
    for layout in LAYOUTS:
        actor = _actor(model_dir, layout)
        params = [(n, p) for c in actor.model for n, p in unwrap(c).named_parameters()]
        step0 = actor.compute_logprobs(batch, GROUP, 1.0).token_logp
        for _ in range(2):
            old = actor.compute_logprobs(batch, GROUP, 1.0).token_logp
            actor.train_step(as_train_batch(batch, old, ref_logp=actor.compute_ref_logprobs(batch, GROUP, 1.0)))
        merged = {n: t.detach().clone() for n, t in actor.export_hf_weights()}  # collective: every rank iterates
        out[layout] = {
            "only_adapters": all(p.requires_grad == (".lora_" in n) for n, p in params),
            "adapters": sum(p.numel() for n, p in params if ".lora_" in n),
            "ref_is_step0": bool((actor.compute_ref_logprobs(batch, GROUP, 1.0) == step0).all()),
            "merged": merged if rank == 0 else None,
        }
    return out


def test_lora_trains_the_same_at_vpp_and_ep(tmp_path):
    from safetensors.torch import load_file

    model_dir = make_qwen3(tmp_path / "m", vocab=VOCAB, moe=True)
    results = run_distributed(_body, 2, model_dir)
    base = load_file(f"{model_dir}/model.safetensors")
    ref = results[0]["dp"]["merged"]
    for layout in LAYOUTS:
        for r in results:
            assert r[layout]["only_adapters"] and r[layout]["adapters"] > 0, layout
            assert r[layout]["ref_is_step0"], layout  # the reference is the frozen base, adapters off
        moved = max(float((ref[n] - base[n]).abs().max()) for n in ref if "self_attn" in n)
        assert moved > 1e-4, "the adapters did not move the attention weights"
        assert all(torch.equal(ref[n], base[n]) for n in ref if "experts" in n or "mlp.gate" in n)  # frozen
        assert rel_update_diff(base, ref, base, results[0][layout]["merged"]) < 1e-3, layout
