"""Per-GPU memory plan of a run, by arithmetic only (no torch, no GPU): what ``doctor --config`` prints.

From the Hugging Face ``config.json`` and the run config, for the worst pipeline stage of one rank: parameters,
the fp32 main-grad buffer, Adam's states (sharded over DP x CP with the distributed optimizer), activations and
fp32 logits at the micro-batch, LoRA's adapters, the reference policy, vLLM's ``gpu_memory_utilization`` share
and routing replay's indices. "Resident during rollout" is actor + vLLM's share; "during training" is actor +
activations (+ vLLM's share if it cannot sleep). The plan "fits" only with :data:`HEADROOM_GIB` left over for
CUDA contexts, NCCL buffers and allocator fragmentation. Each term's bytes, and the Qwen2.5-7B example:
docs/launch.md, "The memory plan".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GIB = 1024**3
HEADROOM_GIB = 4.0
"""Kept free beyond the plan: a CUDA context (~0.5-1 GiB), NCCL's buffers (~1 GiB with a few
communicators), the caching allocator's fragmentation. A plan within this of the GPU's size is
reported as not fitting."""


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU GiB of one rank on its heaviest pipeline stage."""

    params_per_rank: float
    """Parameters held by the rank (count, not bytes)."""
    params_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    vllm_gib: float
    rollout_gib: float
    """Resident while vLLM generates."""
    train_gib: float
    """Resident while the actor trains."""
    gpu_gib: float
    """The GPU's memory the plan is compared with."""
    replay_gib: float = 0.0
    """GPU: one micro-batch's routing replay indices (part of train_gib)."""
    replay_host_gib: float = 0.0
    """Host memory of the routing replay records per rank (not part of the GPU plan)."""
    reference_gib: float = 0.0
    """The frozen reference policy of the KL term, resident in both phases (0: none, or offloaded)."""

    @property
    def peak_gib(self) -> float:
        return max(self.rollout_gib, self.train_gib)

    @property
    def fits(self) -> bool:
        return self.peak_gib + HEADROOM_GIB <= self.gpu_gib

    def as_dict(self) -> dict:
        return asdict(self) | {"peak_gib": self.peak_gib, "headroom_gib": HEADROOM_GIB, "fits": self.fits}


def param_counts(hf: dict) -> dict[str, int]:
    """Parameter counts of a Llama/Qwen2-style decoder from its config.json: per layer (split by TP),
    per-layer norms (replicated), embedding, LM head (0 when tied), final norm."""
    h, inter = hf["hidden_size"], hf["intermediate_size"]
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or h // heads
    q, kvd = heads * head_dim, kv * head_dim
    bias = q + 2 * kvd if hf.get("attention_bias", hf.get("model_type") == "qwen2") else 0
    attn = h * q + 2 * h * kvd + q * h + bias
    mlp = 3 * h * inter  # gate, up, down (SwiGLU)
    vocab = hf["vocab_size"]
    # Qwen3-MoE: every layer's MLP is experts (split over EP, not TP) + a replicated router (the
    # dense-MLP layers of mlp_only_layers / decoder_sparse_step are counted as MoE: an upper bound)
    experts = (
        int(hf.get("num_experts") or hf.get("num_local_experts") or 0) if hf.get("model_type") == "qwen3_moe" else 0
    )
    if experts:
        mlp = 0
    return {
        "experts": experts * 3 * h * int(hf.get("moe_intermediate_size") or 0),
        "router": experts * h,
        "layer_split": attn + mlp,
        "layer_norms": 2 * h,
        "layers": hf["num_hidden_layers"],
        "embedding": vocab * h,
        "lm_head": 0 if hf.get("tie_word_embeddings", False) else vocab * h,
        "final_norm": h,
        "vocab": vocab,
        "hidden": h,
        "num_experts": experts,
        "topk": int(hf.get("num_experts_per_tok") or 0) if experts else 0,
    }


def total_params(hf: dict) -> int:
    c = param_counts(hf)
    per_layer = c["layer_split"] + c["layer_norms"] + c["experts"] + c["router"]
    return c["layers"] * per_layer + c["embedding"] + c["lm_head"] + c["final_norm"]


def estimate(
    hf: dict,
    *,
    tp: int,
    pp: int,
    dp: int,
    gpu_gib: float,
    cp: int = 1,
    bf16: bool = True,
    distributed_optimizer: bool = True,
    seq_len: int = 4096,
    micro_batch: int = 1,
    recompute: bool = False,
    sequence_parallel: bool = False,
    vllm_utilization: float = 0.0,
    vllm_sleeps: bool = True,
    offload_during_rollout: bool = False,
    ep: int = 1,
    replay_rows: tuple[int, int] | None = None,
    reference: bool = False,
    offload_reference: bool = False,
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
) -> MemoryPlan:
    """The plan for one rank (see the module docstring for each term). ``vllm_utilization=0`` means no
    colocated vLLM (the HF engine); ``offload_during_rollout`` moves the actor to CPU while vLLM runs.
    ``replay_rows``: MoE routing replay, ``(rows the rank trains on, rows its engine replica generates)``
    per step; ``reference``: a KL reference policy, kept in host memory with ``offload_reference``.
    ``lora_rank`` > 0: LoRA adapters on ``lora_targets`` (actor/lora/adapters.py) are all that trains: gradients and
    optimizer state are theirs only, and the reference is the base itself (no copy). ``cp``: each rank holds
    ``seq_len / cp`` tokens of every row (parallel/cp_split.py); weights are replicated over CP."""
    c = param_counts(hf)
    layers = c["layers"] // pp
    stage_layers = layers * (c["layer_split"] / tp + c["layer_norms"] + c["experts"] / ep + c["router"])
    first = stage_layers + c["embedding"] / tp + (c["lm_head"] / tp + c["final_norm"] if pp == 1 else 0)
    last = stage_layers + c["lm_head"] / tp + c["final_norm"] if pp > 1 else first
    if pp > 1 and c["lm_head"] == 0:  # tied: the last stage keeps its own copy of the embedding
        last += c["embedding"] / tp
    n = max(first, last)
    # MoE: the distributed optimizer shards expert state over the expert-DP ranks only (tp * dp / ep)
    n_exp = layers * c["experts"] / ep
    # megatron shards the optimizer over DP x CP (its intra_dp_cp group)
    shards = (dp * cp, max(1, tp * dp * cp // ep)) if distributed_optimizer else (1, 1)
    if lora_rank:  # the adapters alone train (dense layers' linears only, never the experts')
        n_lora = layers * lora_params_per_layer(hf, lora_rank, tp, lora_targets)
        params = (n * (2 if bf16 else 4) + n_lora * (2 if bf16 else 4)) / GIB
        grads = n_lora * 4 / GIB
        optimizer = n_lora / shards[0] * (12 if bf16 else 8) / GIB
        reference = False  # the base with the adapters off (actor/lora/reference.py)
    else:
        params = n * (2 if bf16 else 4) / GIB
        grads = n * 4 / GIB
        optimizer = ((n - n_exp) / shards[0] + n_exp / shards[1]) * (12 if bf16 else 8) / GIB
    tokens = seq_len * micro_batch / cp
    hidden = c["hidden"]
    if recompute:
        act = layers * tokens * hidden * 2 + tokens * hidden * 34 / tp
    else:
        per_token_layer = 34 / tp if sequence_parallel else 10 + 24 / tp
        act = layers * tokens * hidden * per_token_layer
    act += tokens * c["vocab"] / tp * 8  # fp32 logits and their gradient on the last stage
    act_gib = act / GIB
    replay = replay_host = 0.0
    if replay_rows is not None and c["topk"]:
        ids = c["layers"] * c["topk"]  # expert ids per token
        replay = tokens * layers * c["topk"] * 8 / GIB
        width = 1 if c["num_experts"] <= 256 else 2
        own, replica = replay_rows
        replay_host = seq_len * ids * (own * width + replica * (2 + width)) / GIB
    vllm = vllm_utilization * gpu_gib
    actor = params + grads + optimizer
    ref = params if reference and not offload_reference else 0.0
    rollout = (0.0 if offload_during_rollout else actor) + vllm + ref
    train = actor + act_gib + replay + (0.0 if vllm_sleeps else vllm) + ref
    return MemoryPlan(
        n, params, grads, optimizer, act_gib, vllm, rollout, train, gpu_gib, replay, replay_host, reference_gib=ref
    )


def lora_params_per_layer(hf: dict, rank: int, tp: int, targets: tuple[str, ...]) -> float:
    """One TP rank's adapter parameters in one transformer layer: a column adapter is A [r, in] + B [out/tp, r],
    a row adapter A [r, in/tp] + B [out, r] (actor/lora/adapters.py)."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv, hd = hf.get("num_key_value_heads") or heads, hf.get("head_dim") or h // heads
    inter = hf.get("intermediate_size", 4 * h)
    shapes = {  # (in, out, column?)
        "linear_qkv": (h, (heads + 2 * kv) * hd, True),
        "linear_proj": (heads * hd, h, False),
        "linear_fc1": (h, 2 * inter, True),
        "linear_fc2": (inter, h, False),
    }
    total = 0.0
    for t in targets:
        i, o, column = shapes[t]
        total += rank * (i + o / tp) if column else rank * (i / tp + o)
    return total


def estimate_run(cfg, hf: dict, gpu_gib: float, offload_during_rollout: bool | None = None) -> MemoryPlan:
    """:func:`estimate` with the settings of a :class:`~pacs_megatron.config.RunConfig`.
    ``offload_during_rollout`` defaults to ``actor.offload_during_rollout`` when the config has it."""
    if offload_during_rollout is None:
        offload_during_rollout = bool(getattr(getattr(cfg, "actor", None), "offload_during_rollout", False))
    par, vllm = cfg.parallel, cfg.rollout.vllm
    use_vllm = cfg.rollout.engine == "vllm"
    dist_opt = cfg.optimizer.use_distributed_optimizer
    replay_rows = None
    if getattr(getattr(cfg, "actor", None), "routing_replay", "none") == "rollout":
        rows = cfg.trainer.train_batch_size * cfg.rollout.n
        world = par.tp * par.pp * getattr(par, "cp", 1) * par.dp
        replicas = world // (vllm.tensor_parallel_size if use_vllm else 1)
        replay_rows = (rows // par.dp, rows // max(1, replicas))
    return estimate(
        hf,
        tp=par.tp,
        pp=par.pp,
        dp=par.dp,
        cp=getattr(par, "cp", 1),
        gpu_gib=gpu_gib,
        bf16=str(cfg.model.dtype) in ("bfloat16", "bf16", "float16", "fp16"),
        distributed_optimizer=dist_opt == "true" or (dist_opt == "auto" and use_vllm),
        seq_len=cfg.data.max_prompt_length + cfg.rollout.max_response_length,
        micro_batch=cfg.algorithm.micro_batch_size,
        recompute=cfg.model.recompute_activations,
        sequence_parallel=par.sequence_parallel,
        vllm_utilization=vllm.gpu_memory_utilization if use_vllm else 0.0,
        vllm_sleeps=vllm.enable_sleep_mode,
        offload_during_rollout=offload_during_rollout,
        ep=getattr(par, "ep", 1),
        replay_rows=replay_rows,
        reference=cfg.algorithm.needs_reference,
        offload_reference=bool(getattr(getattr(cfg, "actor", None), "offload_reference", False)),
        lora_rank=cfg.actor.lora.rank if hasattr(cfg, "actor") else 0,
        lora_targets=tuple(cfg.actor.lora.targets) if hasattr(cfg, "actor") else (),
    )
