"""Actor -> rollout engine weight sync, measured and verified every time.

    actor.export_hf_weights()  -> (hf_name, full tensor), one at a time, on every rank: each feeds its own
                                  engine, a CP rank > 0 too (docs/parallelism.md, "Weight sync")
    iter_buckets(...)          -> buckets of sync.bucket_mb (engines that load in place: one tensor each)
      Recorder                 -> an exact integer fingerprint of each tensor as sent, in the engine's dtype
    engine.update_weights(...) -> the engine loads them (HF: copy by name; vLLM: its layerwise reload)
    bitwise check              -> the engine's fingerprints of what it holds == the sent ones, tensor by tensor
    probe                      -> engine log-probs == actor log-probs (within tol) on fixed random
                                  prompts and the engine's greedy continuation of them

A tensor that differs, or a probe beyond ``sync.probe_tolerance`` / ``sync.probe_greedy_tolerance``, raises
:class:`WeightSyncError`: a corrupted sync looks like "unstable training" and must never be trained on
silently. The bitwise check is the exact one; the probe stays for what bits cannot show (the engine computing
wrongly with them). The two bounds, quantized streams and the adapter-only sync: docs/weight_sync.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.batch.rows import Rollouts
from pacs_megatron.config import RolloutConfig, SyncConfig
from pacs_megatron.rollout.base import PROBE_LEN, ChecksumReader, Generator, WeightReceiver
from pacs_megatron.rollout.types import SamplingParams
from pacs_megatron.rollout.weight_checksum import Recorder, compare
from pacs_megatron.utils.dist import all_gather_objects
from pacs_megatron.utils.logging import get_logger
from pacs_megatron.weight_sync.buckets import iter_buckets
from pacs_megatron.weight_sync.policy import PolicyWeights

if TYPE_CHECKING:
    from pacs_megatron.weight_sync.adapter import AdapterSync
    from pacs_megatron.weight_sync.quantize import WeightQuantizer

logger = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class WeightSyncError(RuntimeError):
    """The engine does not hold the actor's weights after a sync."""


def raise_bitwise(first: str, count: int, where: str) -> None:
    """:class:`WeightSyncError` for a bitwise mismatch: ``count`` held tensors differ, ``first`` the first."""
    raise WeightSyncError(
        f"bitwise check after weight sync: the engine ({where}) does not hold what the actor sent: {first}"
        f"{f' and {count - 1} more tensor(s)' if count > 1 else ''} differ(s) (a stale or corrupted load; "
        "sync.verify_bitwise=false skips this check)"
    )


@dataclass(frozen=True)
class SyncResult:
    """What one sync did.

    Example:
        >>> SyncResult(seconds=0.5, gbytes=1.0, max_logprob_diff=0.0, buckets=4).metrics()["sync/gbytes_per_s"]
        2.0
    """

    seconds: float
    """Wall time of gather + convert + bucket + load (the probe excluded)."""
    gbytes: float
    """Bytes handed to the engine (in the dtype it received), in GB (1e9)."""
    max_logprob_diff: float
    """Max |engine - actor| per-token log-prob on the probe sequences (nan: no probe)."""
    buckets: int
    """Buckets sent."""
    quant_logprob_diff: float = float("nan")
    """Max |engine - actor| per-token log-prob against the actor's unquantized weights: the policy gap
    quantized rollouts introduce (equals max_logprob_diff without quantization)."""
    greedy_logprob_diff: float = float("nan")
    """Mean |engine - actor| log-prob over the greedy continuation tokens (nan: no probe)."""
    bitwise_seconds: float = float("nan")
    """Seconds the bitwise check took: fingerprinting the sent stream, reading the engine back, comparing
    (nan: not checked)."""
    bitwise_tensors: int = 0
    """HF tensors the bitwise check found bit for bit in the engine (0: not checked)."""
    adapter_gbytes: float = float("nan")
    """``sync.lora=adapter``: the adapter file's size in GB, included in ``gbytes`` (nan: a merged sync)."""
    base_sent: float = float("nan")
    """``sync.lora=adapter``: 1 when this sync sent the base too (first sync, PACS v2 reset), else 0."""

    def metrics(self) -> dict[str, float]:
        adapter = {} if math.isnan(self.base_sent) else {
            "sync/adapter_gbytes": self.adapter_gbytes,
            "sync/base_sent": self.base_sent,
        }  # fmt: skip
        return adapter | {
            "sync/seconds": self.seconds,
            "sync/gbytes": self.gbytes,
            "sync/gbytes_per_s": self.gbytes / self.seconds if self.seconds > 0 else float("nan"),
            "sync/max_logprob_diff": self.max_logprob_diff,
            "sync/buckets": float(self.buckets),
            "sync/quant_logprob_diff": self.quant_logprob_diff,
            "sync/greedy_logprob_diff": self.greedy_logprob_diff,
            "sync/bitwise_seconds": self.bitwise_seconds,
            "sync/bitwise_tensors": float(self.bitwise_tensors),
        }


def probe_prompts(
    vocab_size: int, num_sequences: int, seed: int = 1234, length: int = PROBE_LEN // 2
) -> list[list[int]]:
    """Fixed pseudo-random token sequences (same on every rank and every sync), the probe's prompts."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_sequences, length), generator=g).tolist()


def probe_diffs(engine_lp: list[torch.Tensor], actor_lp: torch.Tensor, probe: Rollouts) -> tuple[float, float, float]:
    """``(max |d|, max |d| / max(1, |logp|) over the prompt tokens, mean |d| over the continuation)`` of the
    per-token differences d between the engine's log-probs (``[len - 1]`` per row) and the actor's ``[B, T]``."""
    abs_max = rel_max = 0.0
    cont_sum, cont_n = 0.0, 0
    for b, lp in enumerate(engine_lp):
        n = int(probe.seq_lens[b])
        ref = actor_lp[b, 1:n].double()
        d = (lp.double() - ref).abs()
        cont = probe.response_mask[b, 1:n]
        abs_max = max(abs_max, d.max().item())
        if bool((~cont).any()):
            rel_max = max(rel_max, (d / ref.abs().clamp(min=1.0))[~cont].max().item())
        cont_sum, cont_n = cont_sum + d[cont].sum().item(), cont_n + int(cont.sum())
    return abs_max, rel_max, cont_sum / max(cont_n, 1)


def random_probe_batch(vocab_size: int, num_sequences: int, seed: int = 1234) -> Rollouts:
    """``PROBE_LEN`` random tokens per sequence, every one bounded relative to max(1, |logp|) (no greedy
    part: its response mask is empty): the probe of engines on other ranks (remote.py), which get the
    sequences with the weights, before they could continue them."""
    ids = probe_prompts(vocab_size, num_sequences, seed, PROBE_LEN)
    half = PROBE_LEN // 2
    b = build_rollouts([r[:half] for r in ids], [r[half:] for r in ids], [0.0] * num_sequences, 1, pad_id=0)
    return replace(b, response_mask=torch.zeros_like(b.response_mask))


class WeightSyncer(Protocol):
    """What the loop asks of a weight sync, colocated (:class:`WeightSync`) or to engines on their own ranks
    (remote.py's RemoteWeightSync)."""

    def sync(self, version: int = 0, wait: bool = True) -> SyncResult:
        """Push the actor's weights as policy version ``version``; with ``wait``, verify the engines hold them
        (raises :class:`WeightSyncError`)."""
        ...

    def verify(self, upto: int) -> tuple[float, float]:
        """Verify every version <= ``upto`` not yet verified: ``(max log-prob diff, max quantization gap)``,
        nan when nothing was compared."""
        ...


class WeightSync:
    """Pushes the actor's weights into the engine and checks the result (a :class:`WeightSyncer`)."""

    def __init__(
        self,
        actor: PolicyWeights,
        engine: Generator,
        cfg: SyncConfig,
        vocab_size: int,
        param_dtype: torch.dtype,
        rollout: RolloutConfig | None = None,
    ):
        self.actor, self.engine, self.cfg = actor, engine, cfg
        self.traits = engine.traits()
        """What the engine can do: how it loads, in which dtype it holds the weights, FP8 kernels, adapters."""
        self.verified: tuple[float, float] = (float("nan"), float("nan"))
        """The last :meth:`sync`'s (diff, gap), which :meth:`verify` returns."""
        self.quantizer: WeightQuantizer | None = None
        if rollout is not None and rollout.quantization != "none":
            from pacs_megatron.weight_sync.quantize import WeightQuantizer  # imports modelopt (lazy)

            self.quantizer = WeightQuantizer(rollout.quantization, rollout.quant_recipe, rollout.quant_exclude)
        self._quantized: dict[str, torch.Tensor] = {}  # what the engine got, for the transfer probe
        self.dtype = _DTYPES.get(cfg.dtype)  # None: send in the actor's dtype
        sent = self.dtype or param_dtype
        fp32 = sent == torch.float32
        self.tolerance = cfg.probe_tolerance if cfg.probe_tolerance > 0 else (1e-4 if fp32 else 5e-2)
        """Bound of the per-token relative difference on the random prompt tokens."""
        self.greedy_tolerance = (
            cfg.probe_greedy_tolerance if cfg.probe_greedy_tolerance > 0 else (1e-4 if fp32 else 0.25)
        )
        """Bound of the mean difference over the greedy continuation."""
        self.prompts = probe_prompts(vocab_size, cfg.probe_sequences) if cfg.probe_sequences else None
        self.probe: Rollouts | None = None
        """A fixed probe, for engines on other ranks (remote.py: :func:`random_probe_batch`); the colocated
        sync builds its probe each time (:meth:`probe_batch`, with the engine's greedy continuation)."""
        # Buckets and the cast serve a transport; an engine that copies each tensor into place as it
        # arrives (casting on the copy) gets the stream tensor by tensor, uncast.
        in_place = self.traits.loads_in_place
        self.bucket_bytes = 1 if in_place else cfg.bucket_mb << 20
        self.send_dtype = None if in_place else self.dtype
        if self.quantizer is not None and self.traits.fp8_weights:
            self.send_dtype = None  # FP8 data and float32 scales must arrive as they are (vLLM casts the rest)
        self.recorder: Recorder | None = None
        """The fingerprints of the sync in flight (set by :meth:`push`, used by :meth:`check_bitwise`)."""
        self._told = False  # what the bitwise check cannot read back is logged once
        self.adapter: AdapterSync | None = None
        """``sync.lora=adapter``: the adapter-only sync (weight_sync/adapter.py); None sends merged weights."""
        if cfg.lora == "adapter":
            from pacs_megatron.weight_sync.adapter import AdapterSync

            self.adapter = AdapterSync(actor, engine, self.traits.weight_dtype)

    def push(self) -> SyncResult:
        """Stream the weights into the engine (no probe)."""
        start = time.perf_counter()
        nbytes = 0
        count = 0

        def counted():
            nonlocal nbytes, count
            for bucket in iter_buckets(self._stream(), self.bucket_bytes, self.send_dtype):
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                count += 1
                yield bucket

        self.recorder = Recorder(self.traits.weight_dtype) if self.cfg.verify_bitwise else None
        self.receiver.update_weights(self.recorder.buckets(counted()) if self.recorder else counted())
        return SyncResult(time.perf_counter() - start, nbytes / 1e9, float("nan"), count)

    def check_bitwise(self) -> tuple[float, int]:
        """Collective: compare the fingerprints of what :meth:`push` sent (cast to the engine's dtype) with those
        of the tensors the engine holds now (rollout/weight_checksum.py); raise :class:`WeightSyncError` naming
        the first that differs, on every rank. ``(seconds, tensors verified)``; ``(nan, 0)`` when off or when
        the engine cannot be read back."""
        start = time.perf_counter()
        recorder, self.recorder = self.recorder, None
        reader = self.engine if isinstance(self.engine, ChecksumReader) else None
        held = reader.weight_checksums() if recorder is not None and reader is not None else None
        bad: list[str] = []
        verified = 0
        seconds = float("nan")
        if recorder is not None and held is not None:
            bad, unverified = compare(recorder.sums, held)
            verified = len(recorder.sums) - len(unverified)
            seconds = recorder.seconds + time.perf_counter() - start
            if unverified and not self._told:
                logger.info(
                    "bitwise sync check: %d of %d tensors read back; not read back (probe only): %s%s",
                    verified, len(recorder.sums), unverified[:6], " ..." if len(unverified) > 6 else "",
                )  # fmt: skip
        elif recorder is not None and not self._told:
            logger.warning("bitwise sync check: %s cannot be read back; probe only", type(self.engine).__name__)
        self._told = True
        # every rank checked its own engine: all raise, or none (the next collective would hang)
        verdicts = all_gather_objects((bad[:1], len(bad)))
        for rank, (first, count) in enumerate(verdicts):
            if count:
                raise_bitwise(first[0], count, f"rank {rank}")
        return seconds, verified

    def _stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's export, through the quantizer when rollouts are quantized. An engine with FP8
        kernels (``traits.fp8_weights``: vLLM) gets FP8 data + scales; others the quantize-dequantize.
        With a probe, the dequantized selected tensors are kept (host memory) for the transfer check."""
        if self.adapter is not None:  # the base alone: the adapters travel on their own (adapter.py)
            return self.actor.export_base_weights()
        stream = self.actor.export_hf_weights()
        if self.quantizer is None:
            return stream
        keep = self.prompts is not None
        self._quantized = {}
        if self.traits.fp8_weights:  # written for GPU (vLLM), never run
            return self.quantizer.fp8_stream(self._kept(self.quantizer, stream, dequantize=True) if keep else stream)
        dequantized = self.quantizer.dequantized_stream(stream)
        return self._kept(self.quantizer, dequantized, dequantize=False) if keep else dequantized

    def _kept(
        self, quantizer: WeightQuantizer, stream: Iterable[tuple[str, torch.Tensor]], dequantize: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the stream through, keeping (on the host) the quantize-dequantize of each selected tensor."""
        for name, tensor in stream:
            if quantizer.selects(name, tensor):
                dq = quantizer.fake_quantize(tensor) if dequantize else tensor
                self._quantized[name] = dq.detach().to("cpu", copy=True)
            yield name, tensor

    def probe_batch(self) -> Rollouts:
        """The probe's prompts, each continued greedily by the engine (the same tokens on every rank: the
        first rank's, so that every actor rank scores the same rows)."""
        if self.prompts is None:
            raise ValueError("the probe is off (sync.probe_sequences=0): nothing to continue")
        half = len(self.prompts[0])
        greedy = SamplingParams(n=1, temperature=1.0, top_k=1, max_tokens=PROBE_LEN - half, seed=0)
        cont = [list(g[0].token_ids) for g in self.engine.generate(self.prompts, greedy)]
        cont = all_gather_objects(cont)[0]
        return build_rollouts(self.prompts, cont, [0.0] * len(cont), 1, pad_id=0)

    def _probe_or(self, p: Rollouts | None) -> Rollouts:
        """``p``, or the fixed :attr:`probe` when None (engines on other ranks)."""
        p = self.probe if p is None else p
        if p is None:
            raise ValueError("no probe given and no fixed one (the colocated sync builds its probe each time)")
        return p

    def reference_logprobs(self, p: Rollouts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective on the actor: ``(actor, reference)`` log-probs of the probe ``p`` (default
        :attr:`probe`), where the reference is the actor holding what the engine should hold (its trained
        weights, or their quantize-dequantize)."""
        p = self._probe_or(p)
        actor_lp = self.actor.compute_logprobs(p, micro_batch_size=len(p), temperature=1.0).token_logp
        if self.quantizer is None:
            return actor_lp, actor_lp
        with self.actor.swapped_hf_weights(self._quantized):
            ref_lp = self.actor.compute_logprobs(p, micro_batch_size=len(p), temperature=1.0).token_logp
        self._quantized = {}
        return actor_lp, ref_lp

    def probe_sequences(self, p: Rollouts | None = None) -> list[list[int]]:
        """The token sequences of the probe ``p`` (default :attr:`probe`): what the engine scores."""
        p = self._probe_or(p)
        return [row[: int(n)].tolist() for row, n in zip(p.input_ids, p.seq_lens)]

    def compare(
        self, engine_lp: list[torch.Tensor], actor_lp: torch.Tensor, ref_lp: torch.Tensor, p: Rollouts | None = None
    ) -> tuple[float, float, float, float]:
        """``(max |engine - reference|, the same / max(1, |reference|) over the random prompt tokens, mean
        |engine - reference| over the greedy continuation (0: none), max |engine - actor|)`` per token of
        the probe ``p`` (default :attr:`probe`)."""
        p = self._probe_or(p)
        gap = probe_diffs(engine_lp, actor_lp, p)[0]
        return (*probe_diffs(engine_lp, ref_lp, p), gap)

    def check(self) -> tuple[float, float, float, float]:
        """Probe (collective on the actor): :meth:`compare` of the engine's log-probs of the random prompts
        and its greedy continuation (:meth:`probe_batch`) with the actor's. The second and third values are
        what the tolerances bound (see the module docstring); the last is the quantization gap (the first
        without it)."""
        nan = float("nan")
        if self.prompts is None:
            return nan, nan, nan, nan
        p = self.probe_batch()
        actor_lp, ref_lp = self.reference_logprobs(p)
        return self.compare(self.receiver.logprobs(self.probe_sequences(p)), actor_lp, ref_lp, p)

    def raise_if_off(self, diff: float, scaled: float, greedy: float = float("nan")) -> None:
        """:class:`WeightSyncError` when the probe's scaled difference on the random prompt tokens, or its
        mean difference over the greedy continuation, exceeds its tolerance."""
        if scaled > self.tolerance or greedy > self.greedy_tolerance:
            if scaled > self.tolerance:
                where = f"{scaled:.3g} relative to max(1, |logp|) on the random prompt tokens, > sync.probe_tolerance"
                bound = self.tolerance
            else:
                where = f"{greedy:.3g} on average over the greedy continuation, > sync.probe_greedy_tolerance"
                bound = self.greedy_tolerance
            raise WeightSyncError(
                f"after weight sync the engine's log-probs differ from the actor's by up to {diff:.3g} ({where} "
                f"{bound:.3g}): the engine does not hold the actor's weights"
            )

    def sync(self, version: int = 0, wait: bool = True) -> SyncResult:  # noqa: ARG002
        """Push, then probe; raise :class:`WeightSyncError` above the tolerance. ``version`` (the RL step of the
        weights) matters only to engines on other ranks, which stamp their samples with it (remote.py); an
        engine in process is verified before this returns, ``wait`` or not."""
        if self.adapter is not None:
            pushed, (bit_s, bit_n) = self.adapter.push_all(self)  # the base too when due
        else:
            pushed = self.push()
            bit_s, bit_n = self.check_bitwise()  # exact: first, and its error names the tensor
        diff, scaled, greedy, gap = self.check()
        self.raise_if_off(diff, scaled, greedy)
        self.verified = (diff, gap)
        return replace(
            pushed,
            max_logprob_diff=diff,
            quant_logprob_diff=gap,
            greedy_logprob_diff=greedy,
            bitwise_seconds=bit_s,
            bitwise_tensors=bit_n,
        )

    def verify(self, upto: int) -> tuple[float, float]:  # noqa: ARG002
        """The last sync's ``(diff, gap)``: an engine in process was verified as it loaded, nothing is pending."""
        return self.verified

    @property
    def receiver(self) -> WeightReceiver:
        """The engine as the in-process loads see it (a RolloutEngine; engines on other ranks get their
        weights through remote.py's group instead)."""
        if not isinstance(self.engine, WeightReceiver):
            raise TypeError(f"{type(self.engine).__name__} takes no weights in process: use RemoteWeightSync")
        return self.engine
