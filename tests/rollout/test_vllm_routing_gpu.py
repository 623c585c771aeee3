"""Routing replay (R3) from the real vLLM engine on one GPU: the Megatron actor, replaying the experts vLLM
returned, must give vLLM's sampled-token log-probs; other experts must not.

WRITTEN FOR GPU, NEVER RUN (no GPU with vLLM's CUDA wheel was available; skipped without CUDA). vLLM 0.32
returns routed experts only from Model Runner V2 (Triton), so on CPU the same claim cannot be tested:
tests/rollout/test_vllm_routing.py pins that refusal and tests the array conversion on hand-built arrays.
The tolerances are the CPU MoE test's (tests/actor/test_qwen3_moe.py) widened for GPU kernels in float32;
a first GPU run should confirm them.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

# tests/actor's helpers build the tiny Qwen3-MoE and the actor's config; the CPU replay test uses the same
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "actor"))
from _actor_helpers import GROUP, hf_config, make_qwen3, replay_batch, run_config, shift_experts  # noqa: E402
from _dist import run_distributed  # noqa: E402

from pacs_megatron.config import load_config  # noqa: E402
from pacs_megatron.utils.dist import free_port  # noqa: E402

pytestmark = pytest.mark.gpu
VOCAB = 64
NUM_EXPERTS = 4


def _vllm_rollout(model_dir, monkeypatch):
    """vLLM samples GROUP responses for 4 prompts with routing returned; the batch carries its experts."""
    from pacs_megatron.data.synthetic import build_arith_tokenizer
    from pacs_megatron.loop.build import engine_run
    from pacs_megatron.rollout.types import SamplingParams
    from pacs_megatron.rollout.vllm.engine import VLLMEngine

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "model.dtype=float32",
            "parallel.backend=nccl",
            "rollout.engine=vllm",
            "actor.routing_replay=rollout",
            "rollout.vllm.enforce_eager=true",
            "rollout.vllm.gpu_memory_utilization=0.3",
        ],
    )
    tok = build_arith_tokenizer()
    engine = VLLMEngine(cfg.rollout, engine_run(cfg), model_dir=model_dir, tokenizer=tok, device="cuda:0")
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    try:
        groups = engine.generate(prompts, SamplingParams(n=GROUP, max_tokens=6, temperature=1.0, seed=3))
    finally:
        engine.close()  # frees the GPU and vLLM's process groups before the actor's processes start
    for p, g in zip(prompts, groups):
        for r in g:
            assert r.routed_experts is not None and r.routed_experts.shape[0] == len(p) + len(r.token_ids)
    return replay_batch(prompts, groups)


def _actor_body(rank, world, model_dir, batch):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir)
    cfg = replace(
        cfg,
        model=replace(cfg.model, dtype="float32"),
        parallel=replace(cfg.parallel, backend="nccl"),
        actor=replace(cfg.actor, routing_replay="rollout"),
    )
    actor = build_actor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir)), model_dir)

    def lp(b):
        return actor.compute_logprobs(b, micro_batch_size=GROUP, temperature=1.0).token_logp.cpu()

    return {"replay": lp(batch), "shifted": lp(shift_experts(batch, NUM_EXPERTS))}


def test_actor_replays_vllm_routed_experts_on_gpu(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    model_dir = make_qwen3(tmp_path / "m", vocab=VOCAB, moe=True)
    batch, engine_lp = _vllm_rollout(model_dir, monkeypatch)
    (r,) = run_distributed(_actor_body, 1, model_dir, batch, gpu=True)
    m = batch.response_mask
    # the engine's experts give the engine's log-probs (float32 on both sides, different GPU kernels) ...
    assert (r["replay"] - engine_lp)[m].abs().max() <= 1e-3
    # ... and other experts do not: the replay is what makes them agree
    assert (r["shifted"] - engine_lp)[m].abs().max() > 1e-2
