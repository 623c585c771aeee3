"""model.init=gguf trains the imported model: the actor loads the imported weights (it built a randomly
initialised model before, and the first runs of the SmolLM2 recipe sampled noise from it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _actor_helpers import hf_config, hf_logprobs, run_config, valid_positions
from _dist import run_distributed
from _gguf_helpers import tiny_llama, write_gguf

from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.hf.gguf_import import import_gguf


def _body(rank, world, model_dir, gguf, batch):
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel

    cfg = run_config(model_dir)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="gguf", gguf=gguf))
    actor = build_actor(cfg, initialize_parallel(cfg.parallel, hf_config(model_dir), training=False), model_dir)
    return actor.compute_logprobs(batch, micro_batch_size=2, temperature=1.0).token_logp


@pytest.mark.distributed
def test_init_gguf_actor_holds_the_imported_weights(tmp_path):
    src = write_gguf(tiny_llama(layers=2), tmp_path / "tiny.gguf")
    model_dir = import_gguf(src, tmp_path / "model")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (5,), generator=g).tolist() for _ in range(2)]
    responses = [torch.randint(3, 200, (4,), generator=g).tolist() for _ in range(2)]
    batch = build_rollouts(prompts, responses, [1.0, 0.0], 2, pad_id=0, pad_to_multiple=8)
    ours = run_distributed(_body, 1, str(model_dir), str(src), batch)[0]
    theirs = hf_logprobs(str(model_dir), batch.input_ids)
    valid = valid_positions(batch)
    assert (ours - theirs)[valid].abs().max() < 1e-4  # a random init is ~1 nat away
