"""A megatron-core GPTModel built from a Hugging Face config.json (Qwen2 / Qwen2.5, Llama 3, Qwen3, Qwen3-MoE).

    hf config --model_spec_from_hf (hf/spec.py)--> ModelSpec --transformer_config--> TransformerConfig
              --build_model_chunks--> [GPTModel per virtual pipeline stage] on this rank

Mapping: RMSNorm (``rms_norm_eps``), SwiGLU (``gated_linear_unit`` + silu), grouped-query attention
(``num_query_groups`` = KV heads), qkv bias (Qwen2), RoPE with ``rope_theta`` (and Llama-3 "llama3"
frequency scaling, computed exactly as transformers does and written over megatron's inv_freq, since
megatron hard-codes three of its four parameters), tied or untied embeddings.

Qwen3 adds per-head q/k RMSNorm (megatron's ``qk_layernorm``), no qkv bias and an explicit
``head_dim`` (hidden != heads x head_dim is allowed: megatron's ``kv_channels``). Qwen3-MoE
replaces the MLP of its sparse layers by megatron's MoELayer: a softmax top-k router
(``norm_topk_prob`` -> top-k softmax; without it -> softmax over all experts, then top-k), the
non-grouped ``SequentialMLP`` experts, and the allgather token dispatcher (it runs on gloo).

The layer spec is Transformer Engine's when TE imports (GPU), megatron's local spec otherwise (which
uses Apex norms when present, torch's RMSNorm without), with its core attention replaced by torch's
fused SDPA (actor/attention.py: faster, and it runs THD-packed micro-batches on CPU). On CPU: fp32 by
default (``model.dtype=bfloat16`` works too: norms cast to it, megatron's bf16 optimizer patched in
parallel/cpu_patches.py), ``use_cpu_initialization`` (weights drawn full-size and split, so a seed gives
the same model for any TP), fusions off, dropout 0. The vocabulary is padded to a multiple of TP (see
docs/layout_conversion.md); padded logits are masked out before the softmax (:func:`mask_padded_vocab`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pacs_megatron.hf.spec import ModelSpec
from pacs_megatron.parallel import ParallelGroups


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401

        return torch.cuda.is_available()
    except Exception:
        return False


def transformer_config(
    spec: ModelSpec,
    groups: ParallelGroups,
    dtype: torch.dtype,
    sequence_parallel: bool,
    recompute: bool,
    routing_replay: bool = False,
):
    """megatron TransformerConfig for ``spec`` under this layout.

    ``calculate_per_token_loss=True`` is the gradient convention of the train step: loss functions
    return sums with their unit counts and megatron divides by the total over the mini-batch (see
    train_step.py). ``batch_p2p_comm`` is off on gloo (interleaved PP is wrong with it on gloo).
    MoE: experts are never tensor-parallel (``expert_tensor_parallel_size=1``: EP splits the expert
    list, each expert is whole), no token dropping, the allgather dispatcher, and megatron's own
    load balancing off: the aux loss is actor/moe/aux_loss.py (megatron's scales with the loss units).
    Context parallelism: megatron slices RoPE per CP rank; Transformer Engine's attention runs the p2p
    ring (``cp_comm_type``; **written for GPU, never run**), the CPU's is actor/attention.py's all-gather.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = groups.device.type == "cuda"
    gloo = torch.distributed.get_backend() == "gloo"
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.initializer_range,
        tensor_model_parallel_size=groups.tp_size,
        pipeline_model_parallel_size=groups.pp_size,
        virtual_pipeline_model_parallel_size=groups.vpp_size if groups.vpp_size > 1 else None,
        sequence_parallel=sequence_parallel,
        context_parallel_size=groups.cp_size,
        cp_comm_type="p2p" if groups.cp_size > 1 else None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        calculate_per_token_loss=True,
        batch_p2p_comm=not gloo,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        qk_layernorm=spec.qk_norm,
        **_moe_config(spec, groups, routing_replay),
    )


def _moe_config(spec: ModelSpec, groups: ParallelGroups, routing_replay: bool) -> dict:
    if not spec.is_moe:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.num_experts_per_tok,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_layer_freq=[1 if i in spec.moe_layers else 0 for i in range(spec.num_layers)],
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        expert_model_parallel_size=groups.ep_size,
        expert_tensor_parallel_size=1,
        moe_router_dtype="fp32",
        moe_enable_routing_replay=routing_replay,
    )


def llama3_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies with Llama-3 scaling, as transformers' ``_compute_llama3_parameters``."""
    p = spec.rope_scaling or {}
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def seed_for_init(seed: int, on_gpu: bool) -> None:
    """Seed the generators a model's initialisation draws from (torch's, and megatron's TP tracker), so that
    the actor, the critic, the reference and export build the same random weights from one seed."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:  # model_parallel_cuda_manual_seed needs CUDA; CPU init draws from torch's default generator
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def build_model_chunks(spec: ModelSpec, config, groups: ParallelGroups, local_spec: bool = False) -> list:
    """This rank's GPTModel chunks (one per virtual pipeline stage), on ``groups.device``. ``local_spec``:
    megatron's own layers even where Transformer Engine imports (LoRA wraps megatron's linears, not TE's)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from pacs_megatron.actor.attention import use_sdpa_attention

    te = have_transformer_engine() and not local_spec
    if te:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    else:  # torch SDPA core attention (also for THD-packed micro-batches), actor/attention.py
        layer_spec = use_sdpa_attention(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm))
    chunks = []
    for vp in range(groups.vpp_size):
        if spec.is_moe:  # dense and MoE layers mixed as moe_layer_freq says; this stage's slice
            layer_spec = _moe_block_spec(config, te, vp if groups.vpp_size > 1 else None, groups.pp_rank)
            if not te:
                layer_spec = use_sdpa_attention(layer_spec)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=spec.padded_vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=groups.is_first_stage and vp == 0,
            post_process=groups.is_last_stage and vp == groups.vpp_size - 1,
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=spec.rope_theta,
            pg_collection=groups.pg_collection,
            vp_stage=vp if groups.vpp_size > 1 else None,
        )
        if spec.rope_scaling is not None:
            model.rotary_pos_emb.inv_freq = llama3_inv_freq(spec).to(model.rotary_pos_emb.inv_freq.device)
        _cast_parameters(model, config.params_dtype)
        model.to(groups.device)
        chunks.append(model)
    return chunks


def _cast_parameters(model, dtype: torch.dtype) -> None:
    """Every floating parameter in ``dtype``, as megatron's Float16Module leaves a bf16 model.

    Without Transformer Engine or Apex, the local spec's norms are ``torch.nn.RMSNorm(hidden)``, built
    without ``params_dtype``: fp32 weights in a bf16 model. The distributed optimizer then lists fp32
    shards before bf16 ones in each param group while its index map keeps the model's order, so its
    checkpoint state read the wrong tensors (a size-mismatch crash at the first save, seen on an H100
    without TE, 2026-11-25); and the norms ran torch's slow mixed-dtype path. The router's fp32 maths is
    a compute dtype (``moe_router_dtype``) and is unaffected.
    """
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _moe_block_spec(config, te: bool, vp_stage: int | None, pp_rank: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization="RMSNorm", vp_stage=vp_stage, pp_rank=pp_rank
    )


def global_layer_numbers(chunk) -> list[int]:
    """0-based global indices of a chunk's transformer layers (megatron's layer_number is 1-based)."""
    return [layer.layer_number - 1 for layer in chunk.decoder.layers]


def mask_padded_vocab(
    logits: torch.Tensor, spec: ModelSpec, groups: ParallelGroups, inplace: bool = False
) -> torch.Tensor:
    """Push the padded vocabulary columns (rows >= spec.vocab_size) far below any real logit.

    ``logits`` ``[..., V_local]`` is this TP rank's contiguous shard. A large finite value (not -inf)
    keeps p * logit finite in the entropy. No-op (same tensor) when the vocabulary needs no padding.
    ``inplace`` (the training pass, whose logits have no other reader) fills the buffer itself instead
    of allocating an N x V copy; autograd's version counter would flag a producer that saved it.
    """
    v_local = logits.shape[-1]
    start = groups.tp_rank * v_local
    n_real = max(0, min(v_local, spec.vocab_size - start))
    if n_real == v_local:
        return logits
    pad = torch.arange(v_local, device=logits.device) >= n_real
    return logits.masked_fill_(pad, -1e30) if inplace else logits.masked_fill(pad, -1e30)


def output_weight(chunk) -> torch.Tensor:
    """The LM head's weight ``[V_local, h]`` of a chunk holding the output layer (``post_process``), exactly
    what megatron's ``GPTModel._postprocess`` multiplies by: the shared word embedding for tied models (on
    the first stage the embedding's own parameter; on a later last stage its tied copy), else
    ``output_layer.weight``. The fused LM head (ops/head.py) takes it as an argument."""
    if chunk.share_embeddings_and_output_weights:
        return chunk.shared_embedding_or_output_weight()
    return chunk.output_layer.weight
