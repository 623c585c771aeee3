"""Tiny HF models, run configs and batches shared by the actor tests (importable in spawned ranks)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.batch.rows import Rollouts, TrainRows
from pacs_megatron.config import (
    AlgorithmConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)
from pacs_megatron.data.routing import RoutedExperts
from pacs_megatron.pacs import PolicyLossConfig, outcome_advantages

GROUP = 2


def make_qwen2(path: Path, *, vocab: int = 255, layers: int = 4, tie: bool = True, shard: str | None = None) -> str:
    """A random tiny Qwen2 (hidden 64, 4 heads, 2 KV heads) saved with save_pretrained."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # HF zero-initialises biases; random ones exercise the qkv-bias layout
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    return str(path)


def hf_config(model_dir: str) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def run_config(model_dir: str, tp=1, pp=1, dp=1, vpp=1, init="pretrained", seed=1234, **opt) -> RunConfig:
    """Small-batch config; Adam with a large eps makes the update smooth in the gradient, so layouts
    can be compared on weights after a step."""
    optimizer = OptimizerConfig(**{"lr": 0.5, "weight_decay": 0.0, "adam_eps": 1.0, "clip_grad": 1.0, **opt})
    return RunConfig(
        model=ModelConfig(path=model_dir, init=init, seed=seed),
        parallel=ParallelConfig(tp=tp, pp=pp, dp=dp, vpp=vpp),
        rollout=RolloutConfig(n=GROUP, temperature=1.0),
        # fixed micro-batches: these tests choose micro-batch sizes (test_actor_packing.py turns dynamic on)
        algorithm=AlgorithmConfig(micro_batch_size=2 * GROUP, logprob_micro_batch_size=GROUP, dynamic_batching=False),
        trainer=TrainerConfig(total_steps=4, train_batch_size=4),
        optimizer=optimizer,
    )


def set_algorithm(actor, algorithm: AlgorithmConfig) -> None:
    """Swap a built actor's ``algorithm`` section (its loss, loss sections, batching) between two steps."""
    actor.sections = replace(actor.sections, train=replace(actor.sections.train, algorithm=algorithm))


def sample_batch(vocab: int, groups: int = 4, seed: int = 1) -> TrainRows:
    """``groups`` prompt groups of GROUP responses, ragged lengths, mixed 0/1 scores, GRPO advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, scores = [], [], []
    for k in range(groups):
        prompt = torch.randint(1, vocab, (3 + k % 3,), generator=g).tolist()
        for j in range(GROUP):
            prompts.append(prompt)
            responses.append(torch.randint(1, vocab, (2 + (k + 3 * j) % 5,), generator=g).tolist())
            scores.append(float((k + j) % 2))
    batch = build_rollouts(prompts, responses, scores, GROUP, pad_id=0)
    adv = outcome_advantages(batch.scores, GROUP, PolicyLossConfig(adv_estimator="grpo"))
    return TrainRows.of(batch, advantages=adv)


def hf_logprobs(model_dir: str, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` transformers log-probs in fp32 (column 0 = 0)."""
    from transformers import AutoModelForCausalLM

    return causal_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), input_ids, temperature)


def causal_logprobs(model, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` log-probs of ``input_ids`` under a transformers (or PEFT) causal LM, fp32, column 0 = 0."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def valid_positions(batch: Rollouts) -> torch.Tensor:
    """``[B, T]`` bool: positions 1..len-1 (predicted tokens that are not padding)."""
    t = torch.arange(batch.input_ids.shape[1])
    return (t[None] >= 1) & (t[None] < batch.seq_lens[:, None])


def rel_update_diff(a0: dict, a1: dict, b0: dict, b1: dict) -> float:
    """Two runs' updates a1 - a0 and b1 - b0: max |difference| / max |a1 - a0| over all tensors."""
    num = max(float(((a1[k] - a0[k]) - (b1[k] - b0[k])).abs().max()) for k in a0)
    den = max(float((a1[k] - a0[k]).abs().max()) for k in a0)
    return num / den


def make_qwen3(path: Path, *, vocab: int = 255, layers: int = 4, tie: bool = False, moe: bool = False, **kw) -> str:
    """A random tiny Qwen3 (hidden 64, 4 heads of head_dim 24 != 64/4, 2 KV heads), or Qwen3-MoE with
    4 experts (top-2) when ``moe``; q/k norms are perturbed so that they matter."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        rope_theta=10000.0,
    )
    if moe:
        shape.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
        shape.update(kw)
        cfg, cls = Qwen3MoeConfig(**shape), Qwen3MoeForCausalLM
    else:
        cfg, cls = Qwen3Config(**{**shape, **kw}), Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):  # a sharper router: routing decisions are not near-ties
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return str(path)


def replay_batch(prompts: list[list[int]], groups: list) -> tuple[TrainRows, torch.Tensor]:
    """One engine rollout (``GROUP`` responses per prompt, with ``routed_experts``) as a training batch
    carrying the recorded experts, and the engine's sampled-token log-probs at their batch positions."""
    flat = [(p, r) for p, g in zip(prompts, groups) for r in g]
    scores = [1.0, 0.0] * (len(flat) // 2)
    # padded to a multiple of 8, as the trainer pads (sequence parallelism splits T over TP)
    batch = build_rollouts([p for p, _ in flat], [r.token_ids for _, r in flat], scores, GROUP, 0, 8)
    adv = outcome_advantages(batch.scores, GROUP, PolicyLossConfig(adv_estimator="grpo"))
    batch = TrainRows.of(batch, advantages=adv)
    routed = RoutedExperts.from_records([r.routed_experts for _, r in flat], batch.seq_lens)
    engine_lp = torch.zeros(batch.input_ids.shape)
    engine_lp[batch.response_mask] = torch.tensor([x for _, r in flat for x in r.logprobs])
    return replace(batch, routed_experts=routed), engine_lp


def hf_engine_rollout(model_dir: str, seed: int, max_tokens: int) -> tuple[TrainRows, torch.Tensor]:
    """The HF engine samples GROUP responses to 4 fixed prompts with routing recorded: :func:`replay_batch`."""
    from pacs_megatron.data.synthetic import build_arith_tokenizer
    from pacs_megatron.rollout.hf_engine import HFEngine
    from pacs_megatron.rollout.types import SamplingParams

    engine = HFEngine(model_dir, build_arith_tokenizer(), record_routing=True, seed=seed)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    groups = engine.generate(prompts, SamplingParams(n=GROUP, max_tokens=max_tokens, temperature=1.0))
    return replay_batch(prompts, groups)


def shift_experts(batch: TrainRows, num_experts: int) -> TrainRows:
    """The batch with every recorded expert e replaced by e + 1 (mod ``num_experts``): other experts."""
    r = batch.routed_experts
    shifted = tuple((x.long() + 1).remainder(num_experts).to(x.dtype) for x in r.records)
    return replace(batch, routed_experts=RoutedExperts(r.rows, shifted))


def allow_cpu_sequence_parallel() -> None:
    """Let megatron run sequence parallelism on CPU (call in each spawned rank before building a model).

    Only Transformer Engine's and Apex's norms accept ``sequence_parallel``; megatron's torch-norm
    wrapper asserts it off. An RMSNorm acts on each token alone, so running it on the rank's sequence
    shard is exact; its weight is marked ``sequence_parallel`` so that ``finalize_model_grads`` sums
    its gradient over TP, as it does for TE's norms. The project's own refusal (no TE/Apex) is lifted.
    """
    from megatron.core.transformer import torch_norm

    import pacs_megatron.parallel.layout as layout_mod

    layout_mod._have_te_or_apex = lambda: True
    original = torch_norm.WrappedTorchNorm.__new__
    if getattr(original, "_sp_on_cpu", False):
        return

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm

    new._sp_on_cpu = True
    torch_norm.WrappedTorchNorm.__new__ = new
