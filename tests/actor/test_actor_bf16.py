"""``model.dtype=bfloat16`` on CPU: the actor builds, its log-probs are as close to fp32 as transformers'
own bf16 model is, and a training step follows the fp32 one.

Before parallel/cpu_patches.py wrapped megatron's bf16 optimizer constructors, building this actor raised
``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, torch.cuda.HalfTensor, or
torch.cuda.BFloat16Tensor. Received torch.BFloat16Tensor``.

Tolerance rule (as the kernel tests): the bf16 actor's log-prob error against fp32 transformers is at most
twice the error of transformers' own model loaded in bf16, plus 1e-3 for the different op order.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _actor_helpers import hf_config, hf_logprobs, make_qwen2, run_config, sample_batch, valid_positions
from _dist import run_distributed

from pacs_megatron.batch.rows import as_train_batch

VOCAB = 255


def _body(rank, world, model_dir):  # noqa: ARG001
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = run_config(model_dir, lr=1e-3, adam_eps=1e-8)
        cfg = replace(cfg, model=replace(cfg.model, dtype=dtype))
        groups = initialize_parallel(cfg.parallel, hf_config(model_dir))
        actor = build_actor(cfg, groups, model_dir)
        batch = sample_batch(VOCAB)
        old = actor.compute_logprobs(batch, micro_batch_size=4, temperature=1.0)
        w0 = {n: t.float().clone() for n, t in actor.export_hf_weights()}
        metrics = actor.train_step(as_train_batch(batch, old.token_logp), loss_name="grpo")
        w1 = {n: t.float().clone() for n, t in actor.export_hf_weights()}
        params = {p.dtype for c in actor.model for p in c.parameters()}
        out[dtype] = {"logp": old.token_logp, "metrics": metrics, "w0": w0, "w1": w1, "params": params}
    return out


@pytest.mark.distributed
def test_bf16_actor_on_cpu(tmp_path):
    model_dir = make_qwen2(tmp_path / "m", vocab=VOCAB, tie=True)
    r = run_distributed(_body, 1, model_dir)[0]
    f32, b16 = r["float32"], r["bfloat16"]
    assert b16["params"] == {torch.bfloat16}, "norms and linears run in one dtype"
    batch = sample_batch(VOCAB)
    valid = valid_positions(batch)
    ref = hf_logprobs(model_dir, batch.input_ids)
    assert (f32["logp"] - ref)[valid].abs().max() <= 1e-5

    from transformers import AutoModelForCausalLM

    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = hf16(input_ids=batch.input_ids).logits.float()
    hf16_logp = torch.nn.functional.pad(
        torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1), (1, 0)
    )
    hf_err = (hf16_logp - ref)[valid].abs().max()
    our_err = (b16["logp"] - ref)[valid].abs().max()
    assert our_err <= 2 * hf_err + 1e-3, f"bf16 actor error {our_err:.2e} vs transformers' bf16 {hf_err:.2e}"
    assert our_err > 0, "the bf16 actor did not compute in bf16"

    m32, m16 = f32["metrics"], b16["metrics"]
    assert m16["actor/skipped_steps"] == 0 and abs(m16["actor/grad_norm"] / m32["actor/grad_norm"] - 1) < 0.05
    d32 = torch.cat([(f32["w1"][k] - f32["w0"][k]).flatten() for k in f32["w0"]])
    d16 = torch.cat([(b16["w1"][k] - b16["w0"][k]).flatten() for k in b16["w0"]])
    cos = torch.nn.functional.cosine_similarity(d32, d16, dim=0)
    assert cos > 0.9, f"bf16 update direction differs from fp32's (cosine {cos:.3f})"
