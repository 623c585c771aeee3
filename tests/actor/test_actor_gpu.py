"""The actor on one GPU (TE layer spec when Transformer Engine imports, local spec otherwise).

Written for GPU, never run here (the development machine has no GPU). Run with ``pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch
from _actor_helpers import hf_config, hf_logprobs, make_qwen2, run_config, sample_batch, valid_positions
from _dist import run_distributed
from safetensors.torch import load_file

pytestmark = pytest.mark.gpu


def _gpu_body(rank, world, model_dir, dtype):
    from dataclasses import replace

    from pacs_megatron.actor import MegatronActor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir)
    cfg = replace(cfg, model=replace(cfg.model, dtype=dtype))
    groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
    actor = MegatronActor(cfg, groups, model_dir)
    batch = sample_batch(255)
    exported = {n: t.cpu().clone() for n, t in actor.export_hf_weights(dtype=torch.float32)}
    small = actor.compute_logprobs(batch, 2, 1.0)
    big = actor.compute_logprobs(batch, len(batch), 1.0)
    metrics = actor.train_step(batch.with_(old_logp=small.token_logp))
    return {
        "device": str(groups.device),
        "dtype": str(actor.param_dtype),
        "exported": exported,
        "logp": small.token_logp,
        "invariant_max": float((small.token_logp - big.token_logp).abs().max()),
        "metrics": metrics,
    }


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 1e-1)])
def test_one_gpu_actor(tmp_path, dtype, tol):
    model_dir = make_qwen2(tmp_path / "m", vocab=255)
    # the gloo helper starts the process group; init_distributed keeps it and selects cuda:0
    r = run_distributed(_gpu_body, 1, model_dir, dtype)[0]
    assert r["device"].startswith("cuda") and dtype in r["dtype"]
    orig = load_file(f"{model_dir}/model.safetensors")
    cast = {k: v.to(getattr(torch, dtype)).float() for k, v in orig.items()}
    assert all(torch.equal(r["exported"][k], cast[k]) for k in orig)
    batch = sample_batch(255)
    diff = (r["logp"] - hf_logprobs(model_dir, batch.input_ids))[valid_positions(batch)]
    assert diff.abs().max() <= tol
    assert r["invariant_max"] <= tol  # GPU kernels are not batch invariant; bounded, not exact
    assert torch.isfinite(torch.tensor(r["metrics"]["actor/grad_norm"]))
