"""A bf16 actor holds every parameter in bf16, also without Transformer Engine or Apex.

The local spec's norms (``torch.nn.RMSNorm``) are built in fp32 whatever ``params_dtype`` says; a bf16
model with fp32 norms crashed megatron's distributed optimizer at its first checkpoint on an H100
(its param groups list fp32 shards first, its index map does not). Built on CPU over gloo: the chunks
need no optimizer to show the dtypes.
"""

from __future__ import annotations

import pytest
import torch
from _actor_helpers import hf_config, make_qwen2, run_config
from _dist import run_distributed


def _dtypes_body(rank, world, model_dir):
    from transformers import AutoConfig

    from pacs_megatron.actor.model import build_model_chunks, transformer_config
    from pacs_megatron.hf.spec import model_spec_from_hf
    from pacs_megatron.parallel import initialize_parallel

    groups = initialize_parallel(run_config(model_dir).parallel, hf_config(model_dir))
    spec = model_spec_from_hf(AutoConfig.from_pretrained(model_dir))
    config = transformer_config(spec, groups, torch.bfloat16, sequence_parallel=False, recompute=False)
    (chunk,) = build_model_chunks(spec, config, groups)
    return {name: p.dtype for name, p in chunk.named_parameters()}


@pytest.mark.distributed
def test_bf16_chunks_hold_only_bf16_parameters(tmp_path):
    dtypes = run_distributed(_dtypes_body, 1, make_qwen2(tmp_path / "m", layers=2))[0]
    assert any("layernorm" in n or "norm" in n for n in dtypes)  # the norms are among them
    wrong = {n: d for n, d in dtypes.items() if d != torch.bfloat16}
    assert not wrong, wrong
