"""The actor on one GPU (TE layer spec when Transformer Engine imports, local spec otherwise).

Passed on an H100 without Transformer Engine (local spec), 2026-11-25; the fused-head variants on an H200,
2026-11-28. Run with ``pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch
from _actor_helpers import hf_config, hf_logprobs, make_qwen2, run_config, sample_batch, valid_positions
from _dist import run_distributed
from safetensors.torch import load_file

from pacs_megatron.batch.rows import as_train_batch

pytestmark = pytest.mark.gpu


def _gpu_body(rank, world, model_dir, dtype, fused_head="false"):
    from dataclasses import replace

    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir)
    cfg = replace(cfg, model=replace(cfg.model, dtype=dtype, fused_lm_head=fused_head))
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    actor = build_actor(cfg, groups, model_dir)
    batch = sample_batch(255)
    exported = {n: t.cpu().clone() for n, t in actor.export_hf_weights(dtype=torch.float32)}
    small = actor.compute_logprobs(batch, 2, 1.0)
    big = actor.compute_logprobs(batch, len(batch), 1.0)
    metrics = actor.train_step(as_train_batch(batch, small.token_logp))
    return {
        "device": str(groups.device),
        "dtype": str(actor.param_dtype),
        "exported": exported,
        "logp": small.token_logp,
        "invariant_max": float((small.token_logp - big.token_logp).abs().max()),
        "metrics": metrics,
    }


@pytest.mark.parametrize("fused_head", ["false", "true"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 1e-1)])
def test_one_gpu_actor(tmp_path, dtype, tol, fused_head):
    """fused_head: the LM head fused into the log-prob op (ops/head.py) on CUDA, the same checks."""
    model_dir = make_qwen2(tmp_path / "m", vocab=255)
    # the helper starts an NCCL process group; init_distributed keeps it and selects cuda:0
    r = run_distributed(_gpu_body, 1, model_dir, dtype, fused_head, gpu=True)[0]
    assert r["device"].startswith("cuda") and dtype in r["dtype"]
    orig = load_file(f"{model_dir}/model.safetensors")
    cast = {k: v.to(getattr(torch, dtype)).float() for k, v in orig.items()}
    assert all(torch.equal(r["exported"][k], cast[k]) for k in orig)
    batch = sample_batch(255)
    diff = (r["logp"] - hf_logprobs(model_dir, batch.input_ids))[valid_positions(batch)]
    assert diff.abs().max() <= tol
    assert r["invariant_max"] <= tol  # GPU kernels are not batch invariant; bounded, not exact
    assert torch.isfinite(torch.tensor(r["metrics"]["actor/grad_norm"]))


def _offload_body(rank, world, model_dir):
    from dataclasses import replace

    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir)
    cfg = replace(cfg, model=replace(cfg.model, dtype="bfloat16"))
    cfg = replace(cfg, actor=replace(cfg.actor, offload_during_rollout=True))
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    actor = build_actor(cfg, groups, model_dir)
    batch = sample_batch(255)
    old = actor.compute_logprobs(batch, 2, 1.0).token_logp
    actor.train_step(as_train_batch(batch, old))
    resident = torch.cuda.memory_allocated()
    moved = actor.offload()["actor/offload_gb"] * 1e9
    offloaded = torch.cuda.memory_allocated()
    m = actor.train_step(as_train_batch(batch, old))  # restores lazily
    after = torch.cuda.memory_allocated()
    return {"resident": resident, "offloaded": offloaded, "moved": moved, "after": after, "metrics": m}


def test_offload_frees_gpu_memory_and_restores(tmp_path):
    """actor.offload_during_rollout on CUDA: Adam state + fp32 main params + grad buffer leave the GPU
    (pinned host copies) and come back for the next step. Passed on an H100, 2026-11-25."""
    model_dir = make_qwen2(tmp_path / "m", vocab=255)
    r = run_distributed(_offload_body, 1, model_dir, gpu=True)[0]
    assert r["moved"] > 0 and r["resident"] - r["offloaded"] >= 0.9 * r["moved"], r  # the device bytes really went
    assert r["after"] >= 0.9 * r["resident"] and r["metrics"]["actor/nan_skipped_steps"] == 0.0
