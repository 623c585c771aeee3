"""Rollout engine on Hugging Face transformers: the CPU default and a small-GPU fallback.

A hand-written sampling loop over the model's forward with a KV cache, rather than ``generate()``:
it samples from its own ``torch.Generator`` (seeded per call; the process's global RNG, which the
trainer seeds, is never touched) and returns the log-prob of every sampled token under the
distribution it was drawn from (:func:`sampling_logprobs`: temperature, then top-k, then top-p, each
renormalised), as vLLM's ``processed_logprobs`` does. With top-k / top-p off (training's default) that
is ``log_softmax(logits / T)``, the quantity the actor recomputes.

Layout of one generation chunk (P = longest prompt, R = prompts x n rows)::

    prefill : input_ids [U, P] left-padded unique prompts -> last logits [U, V] and cache
              -> both repeated n times (rows r = u * n + j: a prompt's samples are contiguous)
    decode  : t = 0 .. max_tokens-1: sample [R'] -> append -> forward [R', 1] with the cache, where R' are
              the rows still running: a row that samples a stop token leaves the batch and the cache
              (``batch_select_indices``), so decode work follows the live rows, not the longest one

Position ids count real tokens only (``cumsum(mask) - 1``), so a left-padded prompt sees exactly the
positions and attention it would see alone; results match an unpadded forward to fp32 round-off.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from pacs_megatron.rollout.base import EngineTraits, NamedTensors
from pacs_megatron.rollout.collect import ShardedSteps
from pacs_megatron.rollout.stop_tokens import resolve_stop_token_ids
from pacs_megatron.rollout.types import Response, SamplingParams
from pacs_megatron.rollout.weight_checksum import Held, checksum
from pacs_megatron.utils.dist import rank_and_world
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# transformers 5 keeps a MoE layer's experts fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj);
# checkpoints (and the actor's export) name them one expert at a time.
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fused_expert_slice(params: dict[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor] | None:
    """(fused parameter name, the view of it that HF tensor ``name`` fills), or None when ``name`` is
    not a per-expert tensor of a fused-experts model."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, g, proj = m.group(1), int(m.group(2)), m.group(3)
    fused = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    p = params.get(fused)
    if p is None or g >= p.shape[0]:
        return None
    if proj == "down_proj":
        return fused, p[g]
    half = p.shape[1] // 2
    return fused, p[g, :half] if proj == "gate_proj" else p[g, half:]


def cache_kwarg(model) -> str:
    """The keyword the model's forward takes its KV cache by: ``cache`` in transformers >= 5.23, where
    ``past_key_values`` still works but warns (once per call site: the prefill's and the decode's, two
    warnings in every run's log), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _has_weights(model_dir: Path) -> bool:
    return any((model_dir / f).exists() for f in _WEIGHT_FILES)


def sampling_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """``[R, V]`` the logits the engines sample from: ``logits / T``, then -inf outside the top-k, then
    outside the top-p nucleus of the renormalised top-k distribution (vLLM's order and boundary: a token
    stays while the mass of the more likely ones is below top_p). Their log-softmax is the definition of
    ``Response.logprobs`` on every engine (vLLM: ``logprobs_mode="processed_logprobs"``).

    Example:
        >>> torch.log_softmax(sampling_logits(torch.tensor([[0.0, 1.0, 2.0]]), SamplingParams(top_k=2)), -1)
        tensor([[   -inf, -1.3133, -0.3133]])
    """
    scaled = logits.float() / sampling.temperature
    masked = scaled
    vocab = scaled.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
        masked = masked.masked_fill(masked < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(masked, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        masked = masked.masked_fill(drop, float("-inf"))
    return masked


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return ``(tokens [R], logp [R])``, ``logp`` the sampled token's log-prob
    under the distribution it was drawn from (:func:`sampling_logits`).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> tok, lp = sample_tokens(torch.tensor([[0.0, 9.0, 0.0]]), SamplingParams(top_k=1), g)
        >>> tok.tolist(), lp.item()  # top-k=1 leaves one token: probability 1
        ([1], 0.0)
    """
    masked = sampling_logits(logits, sampling)
    probs = torch.softmax(masked, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, torch.log_softmax(masked, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def _layer_index(module_name: str) -> int:
    """The decoder layer of a module from its name (``model.layers.7.mlp.gate`` -> 7)."""
    parts = module_name.split(".")
    i = parts.index("layers") if "layers" in parts else -1
    if i < 0 or i + 1 >= len(parts) or not parts[i + 1].isdigit():
        raise ValueError(f"routing replay: cannot tell the decoder layer of router {module_name!r}")
    return int(parts[i + 1])


class RoutingRecorder:
    """Records the experts every MoE router of a transformers model picks (forward hooks).

    A router here is a module whose forward returns ``(logits, scores, indices)`` (transformers'
    ``*TopKRouter``, e.g. Qwen3-MoE's ``mlp.gate``). :meth:`take` returns the last forward's choices
    as ``[rows, cols, L, k]`` int16 with L = every decoder layer (the actor replays by global layer
    number, ``actor/moe/routing.py``); a dense layer (``mlp_only_layers``, ``decoder_sparse_step``) holds
    0..k-1, never read. :meth:`attach` cuts them into each Response's ``routed_experts``
    ``[prompt + response tokens, L, k]``. The last response token is never fed to the model (nothing
    is sampled after it): its row holds 0..k-1, like padding.
    """

    def __init__(self, model) -> None:
        found = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
        if not found:
            raise ValueError(f"routing replay: {type(model).__name__} has no MoE router to record")
        self.routers = [m for _, m in found]
        self.layers = [_layer_index(n) for n, _ in found]  # "model.layers.7.mlp.gate" -> 7
        self.num_layers = int(model.config.num_hidden_layers)
        self.topk = self.routers[0].top_k
        self._last: list[torch.Tensor | None] = [None] * len(self.routers)
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, output):
            self._last[i] = output[2]

        return hook

    def take(self, shape: tuple[int, int]) -> torch.Tensor:
        out = torch.arange(self.topk, dtype=torch.int16).expand(*shape, self.num_layers, self.topk).clone()
        for layer, t in zip(self.layers, self._last):
            if t is None:
                raise RuntimeError(f"routing replay: the router of layer {layer} did not run in the last forward")
            out[:, :, layer] = t.reshape(*shape, self.topk).to("cpu", torch.int16)
        return out

    def filler(self, rows: int) -> torch.Tensor:
        """``[rows, 1, L, k]`` int16 routing record of rows that decode nothing (0..k-1, as padding)."""
        return torch.arange(self.topk, dtype=torch.int16).expand(rows, 1, self.num_layers, self.topk).clone()

    def attach(self, responses: list, steps: torch.Tensor, prompt_lens: list[int], width: int) -> list:
        """``steps`` ``[R, width + decode steps, L, k]``: left-padded prompt columns, then one column per
        fed token. Returns ``responses`` with ``routed_experts`` set."""
        from dataclasses import replace

        n = len(responses[0])
        filler = torch.arange(self.topk, dtype=torch.int16)
        out = []
        for i, group in enumerate(responses):
            rows = []
            for j, resp in enumerate(group):
                r = steps[i * n + j]
                known = r[width - prompt_lens[i] : width + len(resp.token_ids)]
                full = filler.expand(prompt_lens[i] + len(resp.token_ids), *r.shape[1:]).clone()
                full[: known.shape[0]] = known
                rows.append(replace(resp, routed_experts=full))
            out.append(rows)
        return out


class HFEngine(ShardedSteps):
    """:class:`~pacs_megatron.rollout.base.RolloutEngine` on a transformers causal LM, one replica per rank.

    Example:
        >>> engine = HFEngine("outputs/model", tokenizer, device="cpu")  # doctest: +SKIP
        >>> groups = engine.generate([[6, 13, 8, 14]], SamplingParams(n=4, max_tokens=3, seed=1))  # doctest: +SKIP
    """

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        batch_size: int = 64,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        record_routing: bool = False,
    ) -> None:
        """Load ``model_dir`` (config.json, weights optional: without them random init, to be replaced
        by :meth:`update_weights`). ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA;
        ``batch_size`` is the number of prompts generated together; ``stop_token_ids`` is
        ``rollout.stop_token_ids`` (empty: tokenizer EOS + generation_config.json EOS, as vLLM's engine).
        ``record_routing`` (MoE models, actor.routing_replay=rollout): each Response carries the experts
        every router chose for its tokens (:class:`RoutingRecorder`)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"HF engine: {model_dir}/config.json not found (model.path)")
        self.device = torch.device(device)
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        if _has_weights(model_dir):
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype, local_files_only=True)
        else:
            config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
            logger.info("HF engine: %s has no weights; random init until the first weight sync", model_dir)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self._cache_kw = cache_kwarg(self.model)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.eos_token_id = tokenizer.eos_token_id
        if self.eos_token_id is None:
            raise ValueError("HF engine: the tokenizer has no eos_token; generation could never stop")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id
        self.stop_token_ids = resolve_stop_token_ids(tokenizer, model_dir, stop_token_ids)
        self._seed = seed
        self._asleep = False
        self._calls = 0
        self._params = dict(self.model.named_parameters())  # tied weights appear once
        self._tied = {
            name: self._param_name(getattr(self.model.get_output_embeddings(), "weight", None))
            for name in ("lm_head.weight",)
            if name not in self._params
        }

        self.routing = RoutingRecorder(self.model) if record_routing else None

    def traits(self) -> EngineTraits:
        """A replica per rank; :meth:`update_weights` copies each tensor straight into its parameter, casting
        on the copy (on CPU buckets and a pre-cast made the sync of a 100M model 2-3x slower)."""
        rank, world = rank_and_world()
        return EngineTraits(replica=rank, replicas=world, loads_in_place=True, weight_dtype=self.dtype)

    def _param_name(self, p: torch.Tensor | None) -> str | None:
        return next((n for n, q in self._params.items() if q is p), None)

    # -- generation -------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[list[Response]]:
        """``sampling.n`` responses per prompt, in prompt order (deterministic for a given ``seed``)."""
        self.wake()
        if sampling.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature={sampling.temperature} must be > 0 (greedy: top_k=1)")
        if sampling.max_tokens <= 0:
            raise ValueError(f"SamplingParams.max_tokens={sampling.max_tokens} must be > 0")
        if any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("HF engine: a prompt has no tokens")
        seed = sampling.seed if sampling.seed is not None else self._seed + self._calls
        self._calls += 1
        generator = torch.Generator(device=self.device).manual_seed(int(seed))
        out: list[list[Response]] = []
        for start in range(0, len(prompt_token_ids), self.batch_size):
            out.extend(self._generate_chunk(prompt_token_ids[start : start + self.batch_size], sampling, generator))
        return out

    def _generate_chunk(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, generator) -> list:
        from transformers import DynamicCache

        n, dev = sampling.n, self.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: the last column is every prompt's last token
            ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **{self._cache_kw: cache},
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        steps = [self.routing.take(ids.shape).repeat_interleave(n, dim=0)] if self.routing else []
        if n > 1:  # one prefill per prompt, then n rows each
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            mask = mask.repeat_interleave(n, dim=0)
            positions = positions.repeat_interleave(n, dim=0)
        rows = logits.shape[0]
        stop_ids = torch.tensor(sorted({*self.stop_token_ids, *sampling.stop_token_ids}), device=dev)
        next_pos = positions[:, -1] + 1
        alive = torch.arange(rows, device=dev)  # rows still decoding; a finished row leaves the batch
        tokens = torch.full((rows, sampling.max_tokens), self.pad_token_id, dtype=torch.long, device=dev)
        logps = torch.zeros((rows, sampling.max_tokens), dtype=torch.float32, device=dev)
        ends = torch.zeros(rows, dtype=torch.long, device=dev)  # > 0: the row stopped on a string, this long
        for t in range(sampling.max_tokens):
            tok, lp = sample_tokens(logits, sampling, generator)
            tokens[alive, t], logps[alive, t] = tok, lp.float()
            running = ~torch.isin(tok, stop_ids)
            if sampling.stop:
                hit = self._stop_string_hit(tokens[alive, : t + 1], sampling.stop) & running
                ends[alive[hit]] = t + 1
                running &= ~hit
            if t == sampling.max_tokens - 1 or not bool(running.any()):
                tokens, logps = tokens[:, : t + 1], logps[:, : t + 1]
                break
            if not bool(running.all()):  # drop finished rows (and their cache): no decode work on padding
                keep = running.nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                alive, mask, next_pos, tok = alive[keep], mask[keep], next_pos[keep], tok[keep]
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)
            logits = self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                **{self._cache_kw: cache},
                use_cache=True,
            ).logits[:, -1]
            if self.routing:  # finished rows hold the filler (never read: past their last token)
                step = self.routing.filler(rows)
                step[alive.cpu()] = self.routing.take((len(alive), 1))
                steps.append(step)
            next_pos = next_pos + 1
        responses = self._to_responses(tokens, logps, stop_ids, len(prompts), n, ends)
        if self.routing:
            responses = self.routing.attach(responses, torch.cat(steps, dim=1), [len(p) for p in prompts], width)
        return responses

    def _stop_string_hit(self, tokens: torch.Tensor, stops: Sequence[str]) -> torch.Tensor:
        """[R] bool: the rows whose text now ends a stop string. Only the last few tokens are decoded (a stop
        string of c characters spans at most c tokens), every step, so the first completing token is found."""
        window = max(len(s) for s in stops) + 2
        texts = self.tokenizer.batch_decode(tokens[:, -window:].tolist(), skip_special_tokens=False)
        return torch.tensor([any(s in x for s in stops) for x in texts], dtype=torch.bool, device=tokens.device)

    def _to_responses(
        self, tokens: torch.Tensor, logps: torch.Tensor, stop_ids, num_prompts: int, n: int, ends: torch.Tensor
    ) -> list:
        """[R, L] sampled tokens -> Responses cut after the first stop token, or where a stop string ended
        (``ends`` > 0)."""
        is_stop = torch.isin(tokens, stop_ids)
        has_stop = is_stop.any(1)
        first = torch.where(
            has_stop, is_stop.int().argmax(1), torch.full_like(has_stop, tokens.shape[1], dtype=torch.long)
        )
        by_string = ends > 0  # such a row left the batch there: what follows is padding (maybe the EOS id)
        lengths = torch.where(by_string, ends, torch.where(has_stop, first + 1, first)).tolist()
        has_stop = has_stop | by_string
        tok_rows, lp_rows = tokens.cpu().tolist(), logps.float().cpu().tolist()
        seqs = [tuple(row[:k]) for row, k in zip(tok_rows, lengths)]
        texts = self.tokenizer.batch_decode([list(s) for s in seqs], skip_special_tokens=True)
        flags = has_stop.tolist()
        responses = [
            Response(token_ids=s, text=text, finish_reason="stop" if f else "length", logprobs=tuple(lp[: len(s)]))
            for s, text, f, lp in zip(seqs, texts, flags, lp_rows)
        ]
        return [responses[i * n : (i + 1) * n] for i in range(num_prompts)]

    # -- log-probs of given sequences ---------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, token_ids: Sequence[Sequence[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-token log-probs ``[len-1]`` (token t given tokens < t) of each sequence, float32 on CPU.

        Sequences are right-padded in batches: with a causal model a pad only follows the tokens it
        could affect, so results equal a per-sequence forward.
        """
        self.wake()
        out: list[torch.Tensor] = []
        for start in range(0, len(token_ids), self.batch_size):
            chunk = [list(s) for s in token_ids[start : start + self.batch_size]]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, s in enumerate(chunk):
                ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
                mask[i, : len(s)] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float() / temperature
            logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()
            out.extend(logp[i, : len(s) - 1] for i, s in enumerate(chunk))
        return out

    # -- weights -------------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[NamedTensors]) -> int:
        """Copy full HF-named tensors into the model; return how many parameters were written.

        Raises ``KeyError`` naming an unknown tensor, ``ValueError`` on a shape mismatch, and
        ``RuntimeError`` naming every parameter no bucket wrote (a partial sync). With tied embeddings
        ``lm_head.weight`` may be sent or not; it writes the shared embedding.
        """
        self.wake()
        written: set[str] = set()
        slices: dict[str, int] = {}  # fused expert parameter -> elements written so far
        for bucket in buckets:
            for name, tensor in bucket:
                target = self._tied.get(name, name)
                param = self._params.get(target) if target is not None else None
                fused = fused_expert_slice(self._params, name) if param is None else None
                if fused is not None:
                    target, param = fused
                    slices[target] = slices.get(target, 0) + param.numel()
                if param is None or target is None:
                    raise KeyError(f"HF engine: weight {name!r} matches no parameter of {type(self.model).__name__}")
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"HF engine: weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                    )
                param.copy_(tensor)  # one pass: copy_ converts device and dtype itself (no temporary)
                written.add(target)
        written -= {n for n, count in slices.items() if count != self._params[n].numel()}  # some experts unsent
        missing = sorted(set(self._params) - written)
        if missing:
            raise RuntimeError(f"HF engine: weight sync left {len(missing)} parameters unwritten: {missing}")
        return len(written)

    @torch.no_grad()
    def weight_checksums(self) -> list[Held]:
        """Every parameter as held now, fingerprinted for the bitwise sync check (rollout/weight_checksum.py):
        one entry per HF tensor; a fused expert parameter as the per-expert slices the sync writes."""
        from pacs_megatron.rollout.vllm.reload import checkpoint_names

        self.wake()
        out = []
        for name, p in self._params.items():
            names = checkpoint_names(name, p.shape[0] if p.dim() else 0)
            for hf in names:
                part = (name, p) if names == [name] else fused_expert_slice(self._params, hf)
                if part is None:
                    raise RuntimeError(f"HF engine: checkpoint tensor {hf} is no slice of the parameter {name}")
                out.append(Held(hf, (hf,), checksum(part[1], self.dtype)))
        return out

    def close(self) -> None:
        """Nothing to release: the model is plain torch memory."""

    def sleep(self) -> None:
        """On CUDA, move the weights to host memory; on CPU a no-op (nothing to free). Every other
        method wakes the engine first, as vLLM's does."""
        if self.device.type == "cuda" and not self._asleep:  # GPU: ran on an H100 and an H200 (docs/benchmarks.md)
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self._asleep = True

    def wake(self) -> None:
        """Undo :meth:`sleep` (idempotent)."""
        if self._asleep:  # GPU only (ran there: train.py sleeps the colocated engine every step)
            self.model.to(self.device)
            self._asleep = False
