"""The policy's model without its optimizer: the one builder of :class:`MegatronActor` and ``export``.

    config, chunks = build_policy_model(spec, groups, dtype, seed=model.seed, lora=actor.lora, base_dir=model_dir)

The order is the contract: the seeded init, then the HF base when ``base_dir`` names one, then the adapters.
``export`` passes no base: its checkpoint holds the weights (an adapter-only one loads its base itself,
actor/checkpoint.py). The actor adds DDP, the optimizer and the fused head; the reference (actor/reference.py)
and the critic (actor/critic.py) build theirs here too, without adapters or a base, and fill them themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pacs_megatron.actor.lora.adapters import apply_lora
from pacs_megatron.actor.model import build_model_chunks, seed_for_init, transformer_config
from pacs_megatron.actor.weights import load_hf_weights
from pacs_megatron.config import LoRAConfig
from pacs_megatron.hf.spec import ModelSpec
from pacs_megatron.parallel import ParallelGroups

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


def build_policy_model(
    spec: ModelSpec,
    groups: ParallelGroups,
    dtype: torch.dtype,
    *,
    seed: int,
    lora: LoRAConfig | None = None,
    base_dir: str | None = None,
    sequence_parallel: bool = False,
    recompute: bool = False,
    routing_replay: bool = False,
) -> tuple[TransformerConfig, list]:
    """This rank's policy chunks and their config: drawn from ``seed``, ``base_dir``'s HF weights loaded when
    given, then ``lora``'s adapters (when enabled; A seeded by ``seed``) with everything else frozen.

    The same arguments give the same chunks bit for bit, and the caller's RNG streams are left as they were.
    ``sequence_parallel``, ``recompute`` and ``routing_replay`` go to :func:`transformer_config` as given."""
    config = transformer_config(spec, groups, dtype, sequence_parallel, recompute, routing_replay=routing_replay)
    on_gpu = groups.device.type == "cuda"
    adapted = lora is not None and lora.enabled
    # A fixed seed for initialisation only; the caller's RNG streams are left as they were.
    with torch.random.fork_rng(devices=[groups.device] if on_gpu else []):
        seed_for_init(seed, on_gpu)
        # LoRA wraps megatron's own linears, not Transformer Engine's
        chunks = build_model_chunks(spec, config, groups, local_spec=adapted)
    if base_dir is not None:
        load_hf_weights(chunks, spec, base_dir, groups)
    if lora is not None and lora.enabled:
        # A is drawn from its own generator (actor/lora/adapters.py), not the global RNG; docs/lora.md
        for c in chunks:
            apply_lora(
                c,
                lora.targets,
                lora.rank,
                lora.alpha,
                lora.dropout,
                seed=seed,
                tp_rank=groups.tp_rank,
                tp_size=groups.tp_size,
            )
    return config, chunks
