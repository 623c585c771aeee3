"""Actor -> rollout engine weight sync, measured and verified every time.

    actor.export_hf_weights()  -> (hf_name, full tensor), one at a time, on every rank
    iter_buckets(...)          -> buckets of sync.bucket_mb (engines that load in place: one tensor each)
    engine.update_weights(...) -> the engine loads them (HF: copy by name; vLLM: its layerwise reload)
    probe                      -> engine log-probs on fixed sequences == actor log-probs (within tol)

With ``rollout.quantization`` (fp8/nvfp4) the stream passes through modelopt's quantizers first
(``quantize.py``) and the probe measures two things: transfer exactness against the actor holding the
same quantize-dequantized weights for one forward (``sync/max_logprob_diff``, bounded by the tolerance),
and the quantization gap against the trained weights (``sync/quant_logprob_diff``, logged only).

A probe above the tolerance raises :class:`WeightSyncError`: a corrupted sync looks like "unstable
training" and must never be trained on silently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pacs_megatron.config import RolloutConfig, SyncConfig
from pacs_megatron.data.batching import TrainBatch, build_train_batch
from pacs_megatron.rollout.base import PROBE_LEN, RolloutEngine
from pacs_megatron.weight_sync.buckets import iter_buckets

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class WeightSyncError(RuntimeError):
    """The engine does not hold the actor's weights after a sync."""


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

    def metrics(self) -> dict[str, float]:
        return {
            "sync/seconds": self.seconds,
            "sync/gbytes": self.gbytes,
            "sync/gbytes_per_s": self.gbytes / self.seconds if self.seconds > 0 else float("nan"),
            "sync/max_logprob_diff": self.max_logprob_diff,
            "sync/buckets": float(self.buckets),
            "sync/quant_logprob_diff": self.quant_logprob_diff,
        }


def probe_batch(vocab_size: int, num_sequences: int, seed: int = 1234, length: int = PROBE_LEN) -> TrainBatch:
    """Fixed pseudo-random token sequences (same on every rank and every sync)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_sequences, length), generator=g)
    half = length // 2
    return build_train_batch(
        [r[:half].tolist() for r in ids], [r[half:].tolist() for r in ids], [0.0] * num_sequences, 1, pad_id=0
    )


class WeightSync:
    """Pushes the actor's weights into the engine and checks the result."""

    def __init__(
        self,
        actor,
        engine: RolloutEngine,
        cfg: SyncConfig,
        vocab_size: int,
        param_dtype: torch.dtype,
        rollout: RolloutConfig | None = None,
    ):
        self.actor, self.engine, self.cfg = actor, engine, cfg
        self.quantizer = None
        if rollout is not None and rollout.quantization != "none":
            from pacs_megatron.weight_sync.quantize import WeightQuantizer  # imports modelopt (lazy)

            self.quantizer = WeightQuantizer(rollout.quantization, rollout.quant_recipe, rollout.quant_exclude)
        self._quantized: dict[str, torch.Tensor] = {}  # what the engine got, for the transfer probe
        self.dtype = _DTYPES.get(cfg.dtype)  # None: send in the actor's dtype
        sent = self.dtype or param_dtype
        self.tolerance = cfg.probe_tolerance if cfg.probe_tolerance >= 0 else (1e-4 if sent == torch.float32 else 5e-2)
        self.probe = probe_batch(vocab_size, cfg.probe_sequences) if cfg.probe_sequences else None
        # Buckets and the cast serve a transport; an engine that copies each tensor into place as it
        # arrives (casting on the copy) gets the stream tensor by tensor, uncast.
        in_place = getattr(engine, "loads_in_place", False)
        self.bucket_bytes = 1 if in_place else cfg.bucket_mb << 20
        self.send_dtype = None if in_place else self.dtype
        if self.quantizer is not None and getattr(engine, "fp8_weights", False):
            self.send_dtype = None  # FP8 data and float32 scales must arrive as they are (vLLM casts the rest)

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

        self.engine.update_weights(counted())
        return SyncResult(time.perf_counter() - start, nbytes / 1e9, float("nan"), count)

    def _stream(self):
        """The actor's export, through the quantizer when rollouts are quantized. An engine with FP8
        kernels (``fp8_weights = True``: vLLM) gets FP8 data + scales; others the quantize-dequantize.
        With a probe, the dequantized selected tensors are kept (host memory) for the transfer check."""
        stream = self.actor.export_hf_weights()
        if self.quantizer is None:
            return stream
        keep = self.probe is not None
        self._quantized = {}
        if getattr(self.engine, "fp8_weights", False):  # written for GPU (vLLM), never run
            return self.quantizer.fp8_stream(self._kept(stream, dequantize=True) if keep else stream)
        dequantized = self.quantizer.dequantized_stream(stream)
        return self._kept(dequantized, dequantize=False) if keep else dequantized

    def _kept(self, stream, dequantize: bool):
        """Pass the stream through, keeping (on the host) the quantize-dequantize of each selected tensor."""
        for name, tensor in stream:
            if self.quantizer.selects(name, tensor):
                dq = self.quantizer.fake_quantize(tensor) if dequantize else tensor
                self._quantized[name] = dq.detach().to("cpu", copy=True)
            yield name, tensor

    def _probe_diffs(self, engine_lp: list[torch.Tensor], actor_lp: torch.Tensor) -> tuple[float, float]:
        p = self.probe
        abs_diff = rel_diff = 0.0
        for b, lp in enumerate(engine_lp):
            ref = actor_lp[b, 1 : int(p.seq_lens[b])].double()
            d = (lp.double() - ref).abs()
            abs_diff = max(abs_diff, d.max().item())
            rel_diff = max(rel_diff, (d / ref.abs().clamp(min=1.0)).max().item())
        return abs_diff, rel_diff

    def reference_logprobs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective on the actor: ``(actor, reference)`` log-probs of the probe sequences, where the reference
        is the actor holding what the engine should hold (its trained weights, or their quantize-dequantize)."""
        p = self.probe
        actor_lp = self.actor.compute_logprobs(p, micro_batch_size=len(p), temperature=1.0).token_logp
        if self.quantizer is None:
            return actor_lp, actor_lp
        with self.actor.swapped_hf_weights(self._quantized):
            ref_lp = self.actor.compute_logprobs(p, micro_batch_size=len(p), temperature=1.0).token_logp
        self._quantized = {}
        return actor_lp, ref_lp

    def probe_sequences(self) -> list[list[int]]:
        """The probe's token sequences (what the engine computes log-probs of)."""
        p = self.probe
        return [row[: int(n)].tolist() for row, n in zip(p.input_ids, p.seq_lens)]

    def compare(
        self, engine_lp: list[torch.Tensor], actor_lp: torch.Tensor, ref_lp: torch.Tensor
    ) -> tuple[float, float, float]:
        """``(max |engine - reference|, the same / max(1, |reference|), max |engine - actor|)`` per token."""
        gap, _ = self._probe_diffs(engine_lp, actor_lp)
        abs_diff, rel_diff = self._probe_diffs(engine_lp, ref_lp)
        return abs_diff, rel_diff, gap

    def check(self) -> tuple[float, float, float]:
        """Probe (collective on the actor): :meth:`compare` of the engine's log-probs with the actor's. The
        second value is what the tolerance bounds: float32 rounding grows with the magnitude of a log-prob (a
        trained model gives random probe tokens log-probs of -30 and below), while a wrong or missing tensor
        moves log-probs by O(1) whatever their size. The third is the quantization gap (the first without
        quantization)."""
        if self.probe is None:
            return float("nan"), float("nan"), float("nan")
        actor_lp, ref_lp = self.reference_logprobs()
        return self.compare(self.engine.logprobs(self.probe_sequences()), actor_lp, ref_lp)

    def raise_if_off(self, diff: float, scaled: float) -> None:
        """:class:`WeightSyncError` when the probe's scaled difference exceeds the tolerance."""
        if scaled > self.tolerance:
            raise WeightSyncError(
                f"after weight sync the engine's log-probs differ from the actor's by {diff:.3g} "
                f"({scaled:.3g} relative to max(1, |logp|), > sync.probe_tolerance {self.tolerance:.3g}): "
                "the engine does not hold the actor's weights"
            )

    def sync(self, version: int = 0) -> SyncResult:
        """Push, then probe; raise :class:`WeightSyncError` above the tolerance. ``version`` (the RL step of the
        weights) matters only to engines on other ranks, which stamp their samples with it (remote.py)."""
        pushed = self.push()
        diff, scaled, gap = self.check()
        self.raise_if_off(diff, scaled)
        return SyncResult(pushed.seconds, pushed.gbytes, diff, pushed.buckets, gap)
