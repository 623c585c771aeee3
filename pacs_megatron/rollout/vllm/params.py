"""Pure translation for the vLLM engine (no vllm import): its configs -> ``vllm.LLM`` kwargs on CPU and GPU,
sampling -> ``vllm.SamplingParams`` kwargs and per-request seeds, replica layout, and vLLM's outputs ->
:class:`Response` / log-prob tensors. Unit-tested without vllm (tests/rollout/test_vllm_engine.py); the
engine itself is rollout/vllm/engine.py."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pacs_megatron.config import RolloutConfig
from pacs_megatron.rollout.base import PROBE_LEN
from pacs_megatron.rollout.engine_run import EngineRun
from pacs_megatron.rollout.types import Response, SamplingParams

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_VLLM_DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}
_FINISH = {"stop": "stop", "length": "length"}


def vllm_replica(rank: int, world_size: int, tensor_parallel_size: int) -> tuple[int, int]:
    """``(dp_rank, dp_size)``: which vLLM replica (TP group of consecutive ranks) ``rank`` is in.

    Example:
        >>> vllm_replica(5, 8, 2), vllm_replica(5, 8, 4), vllm_replica(0, 1, 1)
        ((2, 4), (1, 2), (0, 1))
    """
    if tensor_parallel_size < 1 or world_size % tensor_parallel_size:
        raise ValueError(
            f"rollout.vllm.tensor_parallel_size={tensor_parallel_size} must divide the job's {world_size} ranks "
            "(each vLLM replica is a group of consecutive trainer ranks)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    return rank // tensor_parallel_size, world_size // tensor_parallel_size


def has_weights(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / f).exists() for f in _WEIGHT_FILES)


def colocated_memory_utilization(free_bytes: int, total_bytes: int, fraction: float) -> float:
    """vLLM's ``gpu_memory_utilization`` (a fraction of the WHOLE GPU) that gives vLLM ``fraction`` of the
    memory free right now, i.e. after the actor offloaded its optimizer state and grad buffer. vLLM then
    subtracts its own weights and activation peak and makes the rest KV cache.

    Example:
        >>> round(colocated_memory_utilization(60 * 2**30, 80 * 2**30, 0.9), 4)
        0.675
    """
    if total_bytes <= 0 or not 0 < free_bytes <= total_bytes:
        raise ValueError(f"GPU memory: {free_bytes} free of {total_bytes} bytes makes no sense")
    return fraction * free_bytes / total_bytes


def llm_kwargs(
    rollout: RolloutConfig,
    run: EngineRun,
    model_dir: str | Path,
    weights_on_disk: bool,
    gpu_free_total: tuple[int, int] | None = None,
    device_type: str = "cuda",
    fp8_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``vllm.LLM(**kwargs)`` for ``rollout`` and ``run`` (rollout/engine_run.py): colocated (external launcher),
    seeded; sleepable on GPU. With ``run.record_routing`` (``actor.routing_replay=rollout``) on GPU (never run)
    vLLM returns each token's routed experts.
    With ``fp8_config`` (FP8 rollouts, GPU, never run) vLLM loads FP8 weights: :func:`fp8_llm_kwargs`.

    A model directory without weights (``model.init=random|tiny``) loads vLLM's dummy weights; the first
    weight sync replaces them.

    Example:
        >>> from pacs_megatron.config import RolloutConfig
        >>> run = EngineRun(dtype="auto", max_prompt_length=512)
        >>> kw = llm_kwargs(RolloutConfig(engine="vllm"), run, "/m", True)
        >>> kw["distributed_executor_backend"], kw["dtype"], kw["max_model_len"], kw["load_format"]
        ('external_launcher', 'bfloat16', 1536, 'auto')
        >>> kw = llm_kwargs(RolloutConfig(engine="vllm"), run, "/m", True, device_type="cpu")
        >>> kw["dtype"], kw["enable_sleep_mode"], kw["enforce_eager"], kw["kv_cache_memory_bytes"]
        ('float32', False, True, 1073741824)
    """
    v = rollout.vllm
    cpu = device_type == "cpu"
    util = v.gpu_memory_utilization
    if gpu_free_total is not None and run.offload_actor:
        util = colocated_memory_utilization(*gpu_free_total, run.memory_fraction)
    dtype = run.dtype if run.dtype != "auto" else ("float32" if cpu else "bfloat16")
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "tensor_parallel_size": v.tensor_parallel_size,
        "distributed_executor_backend": "external_launcher",
        "dtype": _VLLM_DTYPES[dtype],
        "seed": rollout.seed,
        "gpu_memory_utilization": util,
        "enforce_eager": v.enforce_eager or cpu,
        "enable_sleep_mode": v.enable_sleep_mode and not cpu,  # vLLM refuses sleep mode on CPU
        "max_num_seqs": v.max_num_seqs,
        # the post-sync probe scores PROBE_LEN-token sequences (+1 token vLLM generates and we drop)
        "max_model_len": max(run.max_prompt_length + rollout.max_response_length, PROBE_LEN + 1),
        "load_format": "auto" if weights_on_disk else "dummy",
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",  # stop only on what we pass, as the HF engine does
        "enable_prefix_caching": True,  # n samples share their prompt's KV; reset after every weight update
        "use_tqdm_on_load": False,  # no progress bar of a 1-shard load in the run's console
    }
    if cpu:
        kwargs["kv_cache_memory_bytes"] = int(v.cpu_kv_cache_gib * 2**30)
        # Every prompt prefilled in one scheduler step: vLLM 0.32's CPU runner crashes ("CPU Generator does
        # not use offset") when it rewinds a seeded request's generator after a partial (chunked) prefill,
        # which a step of 64 prompts of ~115 tokens (SmolLM2's recipe) triggers with the default budget.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = v.max_num_seqs * kwargs["max_model_len"]
    if run.record_routing and not cpu:  # refused on CPU (launch/checks/device.py)
        # vLLM's AuxOutput connector: needs Model Runner V2 (picked by default on CUDA with Triton; vLLM
        # raises "requires Model Runner V2" otherwise) and prefix caching (set above)
        kwargs["enable_return_routed_experts"] = True
    return kwargs | fp8_llm_kwargs(fp8_config)


def fp8_llm_kwargs(quantization_config: dict[str, Any] | None) -> dict[str, Any]:
    """Extra ``vllm.LLM`` kwargs for FP8 weights (empty for None): vLLM's FP8 linear method with
    ``quantization_config``, the layout of the weights the sync sends (weight_sync/quantize.py
    ``vllm_fp8_config``), declared as a serialized FP8 checkpoint, and dummy initial weights (the bf16
    checkpoint on disk is not FP8; the trainer syncs before step 1). The reload (rollout/vllm/reload.py)
    re-runs vLLM's FP8 post-load processing after every sync. GPU only: vLLM's CPU backend has no FP8
    kernels (``_C::static_scaled_fp8_quant`` is a stub there). Written for GPU, never run.

    Example:
        >>> fp8_llm_kwargs(None), fp8_llm_kwargs({"quant_method": "fp8"})["hf_overrides"]
        ({}, {'quantization_config': {'quant_method': 'fp8'}})
    """
    if quantization_config is None:
        return {}
    return {
        "quantization": "fp8",
        "hf_overrides": {"quantization_config": quantization_config},
        "load_format": "dummy",
    }


def request_seed(seed: int, prompt_index: int) -> int:
    """Seed of one prompt's request. vLLM seeds the ``n`` samples of a request ``seed + j``, so prompts
    get well-separated seeds (a 56-bit hash of ``(seed, prompt_index)``) rather than ``seed`` each, which
    would draw the same random numbers for every prompt.

    Example:
        >>> request_seed(7, 0) == request_seed(7, 0), request_seed(7, 0) != request_seed(7, 1)
        (True, True)
    """
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def sampling_kwargs(sampling: SamplingParams, stop_token_ids: Sequence[int], seed: int) -> dict[str, Any]:
    """``vllm.SamplingParams(**kwargs)`` of one prompt's request (``seed`` from :func:`request_seed`).

    Example:
        >>> kw = sampling_kwargs(SamplingParams(n=4, top_k=-1, stop_token_ids=(5,)), [2], seed=9)
        >>> kw["n"], kw["top_k"], kw["stop_token_ids"], kw["ignore_eos"], kw["logprobs"], kw["detokenize"]
        (4, 0, [2, 5], True, 0, False)
    """
    if sampling.temperature <= 0:
        raise ValueError(f"SamplingParams.temperature={sampling.temperature} must be > 0 (greedy: top_k=1)")
    if sampling.max_tokens <= 0:
        raise ValueError(f"SamplingParams.max_tokens={sampling.max_tokens} must be > 0")
    stops: dict[str, Any] = {}
    if sampling.stop:  # stop strings need vLLM's detokenizer; special tokens kept so a tag token counts
        stops = {"stop": list(sampling.stop), "include_stop_str_in_output": True, "skip_special_tokens": False}
    return {
        **stops,
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,  # vLLM: 0 disables top-k
        "max_tokens": sampling.max_tokens,
        "seed": seed,
        "stop_token_ids": sorted({*stop_token_ids, *sampling.stop_token_ids}),
        "ignore_eos": True,  # the stop set above is the whole rule (no model / generation-config EOS added)
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": bool(sampling.stop),
    }


def prompt_logprob_kwargs() -> dict[str, Any]:
    """``vllm.SamplingParams`` that score a sequence: prompt log-probs, one greedy (deterministic on every
    TP rank) token that is thrown away."""
    return {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False}


def _token_logprob(position: dict | None, token: int, where: str) -> float:
    if position is None or token not in position:
        raise RuntimeError(f"vLLM returned no log-prob for token {token} at {where}")
    return float(position[token].logprob)


def to_responses(
    outputs: Sequence[Any],
    n: int,
    decode: Callable[[list[list[int]]], list[str]],
    routing: tuple[Sequence[int], int, Sequence[int] | None] | None = None,
) -> list[list[Response]]:
    """vLLM ``RequestOutput``s (one per prompt, in prompt order) -> ``n`` :class:`Response` per prompt.

    ``decode`` turns token lists into texts (the trainer's tokenizer, special tokens skipped). A finish
    reason other than "stop"/"length" (vLLM's "abort"/"error"/"repetition") is an error: it would train
    on a response the sampler never finished. ``routing`` = ``(prompt lengths, num_layers, moe_layers)``
    fills ``Response.routed_experts`` through :func:`routed_experts_from_vllm` (GPU path, never run).
    """
    flat: list[tuple[list[int], str, tuple[float, ...] | None]] = []
    routed: list[torch.Tensor | None] = []
    cached: list[int | None] = []
    for p, out in enumerate(outputs):
        completions = sorted(out.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {p}, expected n={n}")
        for c in completions:
            reason = _FINISH.get(c.finish_reason)
            if reason is None:
                raise RuntimeError(f"vLLM finished prompt {p} sample {c.index} with {c.finish_reason!r}")
            tokens = list(c.token_ids)
            lps = None
            if c.logprobs is not None:
                lps = tuple(
                    _token_logprob(c.logprobs[t], tok, f"prompt {p} output {t}") for t, tok in enumerate(tokens)
                )
            flat.append((tokens, reason, lps))
            cached.append(getattr(out, "num_cached_tokens", None))
            if routing is None:
                routed.append(None)
                continue
            prompt_lens, num_layers, moe_layers = routing
            if c.routed_experts is None:
                raise RuntimeError(f"vLLM returned no routed experts for prompt {p} sample {c.index}")
            routed.append(
                routed_experts_from_vllm(c.routed_experts, prompt_lens[p], len(tokens), num_layers, moe_layers)
            )
    texts = decode([t for t, _, _ in flat])
    responses = [
        Response(tuple(tok), text, reason, lps, routed_experts=r, cached_tokens=c)
        for (tok, reason, lps), text, r, c in zip(flat, texts, routed, cached)
    ]
    return [responses[i * n : (i + 1) * n] for i in range(len(outputs))]


def prompt_logprobs_tensor(token_ids: Sequence[int], prompt_logprobs: Sequence[dict | None] | None) -> torch.Tensor:
    """``[len-1]`` float32: log p(token t | tokens < t) for t = 1..len-1 from vLLM's ``prompt_logprobs``
    (a list, or FlatLogprobs, with None at position 0)."""
    if len(token_ids) < 2:
        return torch.zeros(0)
    if prompt_logprobs is None or len(prompt_logprobs) != len(token_ids):
        got = None if prompt_logprobs is None else len(prompt_logprobs)
        raise RuntimeError(f"vLLM returned {got} prompt log-prob positions for a {len(token_ids)}-token sequence")
    values = [_token_logprob(prompt_logprobs[t], tok, f"position {t}") for t, tok in enumerate(token_ids) if t > 0]
    return torch.tensor(values, dtype=torch.float32)


def moe_layer_indices(model_dir: str | Path) -> tuple[int, list[int]]:
    """``(num_hidden_layers, MoE layer indices)`` from a Qwen3-MoE ``config.json``, by transformers' rule: a
    layer is sparse when it is not in ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step == 0``.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); _ = (Path(d) / "config.json").write_text(
        ...     '{"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}')
        >>> moe_layer_indices(d)
        (4, [1])
    """
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    layers = int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return layers, [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def routed_experts_from_vllm(
    arr: np.ndarray,
    prompt_len: int,
    response_len: int,
    num_layers: int,
    moe_layers: Sequence[int] | None = None,
) -> torch.Tensor:
    """vLLM's ``CompletionOutput.routed_experts`` -> our ``Response.routed_experts``: int16
    ``[prompt_len + response_len, num_layers, k]``. Written for GPU, never run with a real vLLM array (vLLM
    0.32 returns routed experts only on CUDA); the conversion itself is unit-tested on hand-built arrays.

    vLLM 0.32's array (read from its source, see docs/models.md): ``[prompt_len + response_len - 1,
    num_hidden_layers, k]``, uint8 (uint16 past 256 experts), one row per token the model was FED. The
    last sampled token is never fed, so vLLM has no row for it (the scheduler returns rows up to
    ``num_tokens - 1``); like the HF engine's recorder we give it 0..k-1 (causality keeps it from
    mattering). The layer axis is indexed by global decoder layer (what ``actor/moe/routing.py`` replays by);
    vLLM never writes the rows of dense layers (its buffer keeps zeros there, k copies of expert 0), so
    with ``moe_layers`` given they are replaced by 0..k-1 too: k distinct experts, as the batch padding.
    ``routed_experts_prompt_start`` is left at 0: every prompt token has a row.

    Example:
        >>> a = np.array([[[1, 3]], [[2, 0]]], dtype=np.uint8)  # 2-token prompt + 1 response token, 1 layer
        >>> routed_experts_from_vllm(a, 2, 1, 1)[:, 0].tolist()
        [[1, 3], [2, 0], [0, 1]]
    """
    arr = np.asarray(arr)
    fed = prompt_len + response_len - 1
    if arr.ndim != 3 or arr.shape[0] != fed or arr.shape[1] != num_layers:
        raise ValueError(
            f"vLLM routed experts of shape {tuple(arr.shape)}, expected ({fed}, {num_layers}, k): one row per fed "
            f"token ({prompt_len} prompt + {response_len} response tokens, less the never-fed last one) and "
            f"{num_layers} decoder layers"
        )
    if arr.size and int(arr.max()) > torch.iinfo(torch.int16).max:
        raise ValueError(f"vLLM routed experts: expert id {int(arr.max())} does not fit int16")
    k = arr.shape[2]
    out = torch.arange(k, dtype=torch.int16).expand(fed + 1, num_layers, k).clone()
    out[:fed] = torch.from_numpy(arr.astype(np.int16))
    if moe_layers is not None:
        dense = [i for i in range(num_layers) if i not in set(moe_layers)]
        out[:, dense] = torch.arange(k, dtype=torch.int16)
    return out
