"""Loading the actor's full Hugging Face-named tensors into a vLLM model, with a completeness check.

    buckets of (hf_name, full tensor)  --apply_model-->  model.load_weights(bucket) on each local worker
                                                         (vLLM shards for its own TP rank and fuses
                                                          q/k/v -> qkv_proj, gate/up -> gate_up_proj)

Two checks make a partial sync an error rather than a silently half-updated policy:

- by HF name: every tensor a Hugging Face checkpoint of the model holds must arrive (the expected names
  come from the model's transformers class, instantiated on the meta device: no memory, no weights);
  names that only alias another tensor (``lm_head.weight`` with tied embeddings) are optional and are
  dropped before loading (vLLM's loader refuses a tied alias whose canonical tensor is in another bucket);
- by vLLM parameter: the union of the names ``load_weights`` reports loading must cover every parameter
  of the vLLM model (a fused parameter counts as loaded when any of its parts is, which is why the
  HF-name check comes first).

The loader sees the vLLM model only through ``apply_model(fn) -> [fn(model) per local worker]``
(``vllm.LLM.apply_model``), so it is tested on CPU with a fake model. Tensors are handed over as they
come (on the GPU in the real path): no host copy is made here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

NamedTensor = tuple[str, torch.Tensor]
ApplyModel = Callable[[Callable[[Any], Any]], list]


def expected_hf_names(model_dir: str | Path) -> tuple[frozenset[str], frozenset[str]] | None:
    """``(required, optional)`` tensor names of a Hugging Face checkpoint of ``model_dir``'s model.

    Required: parameters and persistent buffers; optional: state-dict names that alias one of them
    (tied LM head). None when transformers cannot build the model class (then only the vLLM
    parameter check runs).

    Example:
        >>> req, opt = expected_hf_names("outputs/model")  # doctest: +SKIP
        >>> "model.embed_tokens.weight" in req, sorted(opt)  # doctest: +SKIP
        (True, ['lm_head.weight'])
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # an architecture transformers does not know: fall back to the vLLM-side check
        logger.warning(
            "vLLM weight sync: cannot list the HF tensor names of %s (%s); checking vLLM params only", model_dir, e
        )
        return None
    required = {n for n, _ in model.named_parameters()}
    required |= {n for n, b in model.named_buffers() if n in model.state_dict()}
    optional = set(model.state_dict()) - required
    return frozenset(required), frozenset(optional)


def _load_bucket(model, bucket: list[NamedTensor]) -> set[str]:
    loaded = model.load_weights(iter(bucket))
    if loaded is None:
        raise RuntimeError(f"{type(model).__name__}.load_weights returned None: cannot verify the weight sync")
    return set(loaded)


def _param_names(model) -> set[str]:
    return {n for n, _ in model.named_parameters()}


class VLLMWeightLoader:
    """Streams buckets into the vLLM model(s) of this process and verifies the sync was complete.

    Example:
        >>> loader = VLLMWeightLoader(llm.apply_model, expected_hf_names(model_dir))  # doctest: +SKIP
        >>> loader.load(iter_buckets(actor.export_hf_weights(), 256 << 20))          # doctest: +SKIP
        339
    """

    def __init__(
        self,
        apply_model: ApplyModel,
        expected: tuple[frozenset[str], frozenset[str]] | None,
        scale_suffixes: tuple[str, ...] = (),
    ) -> None:
        """``scale_suffixes``: extra names ``<required name><suffix>`` accepted (FP8 scales, see
        weight_sync/quantize.py: ``("_scale", "_scale_inv")``)."""
        self.apply_model = apply_model
        self.required, self.optional = expected if expected is not None else (None, frozenset())
        self.scale_suffixes = scale_suffixes

    def _known(self, name: str) -> bool:
        if name in self.required or name in self.optional:
            return True
        return any(name.endswith(s) and name[: -len(s)] in self.required for s in self.scale_suffixes)

    def load(self, buckets: Iterable[list[NamedTensor]]) -> int:
        """Load every bucket; return the number of HF tensors loaded.

        Raises ``KeyError`` on a name the checkpoint format does not have (before loading that bucket),
        ``RuntimeError`` naming the HF tensors that never arrived or the vLLM parameters never written.
        """
        received: set[str] = set()
        written: list[set[str]] = []  # per local worker
        for bucket in buckets:
            names = [n for n, _ in bucket]
            if self.required is not None:
                unknown = [n for n in names if not self._known(n)]
                if unknown:
                    raise KeyError(f"vLLM weight sync: {unknown} are not tensors of this model's HF checkpoint")
            dup = received.intersection(names)
            if dup:
                raise ValueError(f"vLLM weight sync: {sorted(dup)} sent twice")
            received.update(names)
            bucket = [(n, t) for n, t in bucket if n not in self.optional]
            if not bucket:
                continue
            per_worker = self.apply_model(lambda model, b=bucket: _load_bucket(model, b))
            if not written:
                written = [set() for _ in per_worker]
            for acc, loaded in zip(written, per_worker):
                acc.update(loaded)
        if self.required is not None:
            missing = sorted(self.required - received)
            if missing:
                raise RuntimeError(f"vLLM weight sync: {len(missing)} HF tensors never arrived: {missing}")
        params = self.apply_model(_param_names)
        for worker, (have, loaded) in enumerate(zip(params, written or [set() for _ in params])):
            unwritten = sorted(have - loaded)
            if unwritten:
                raise RuntimeError(
                    f"vLLM weight sync: worker {worker} left {len(unwritten)} parameters unwritten: {unwritten}"
                )
        return len(received - self.optional)


# ----------------------------------------------------------------------- FP8 rollouts (GPU, never run)


def fp8_llm_kwargs(rollout) -> dict[str, Any]:
    """Extra ``vllm.LLM`` kwargs for ``rollout.quantization=fp8`` (empty otherwise): vLLM's FP8 linear
    method with the layout of the pushed weights (``quantize.WeightQuantizer.fp8_stream``) declared as a
    serialized FP8 checkpoint, and dummy initial weights (the bf16 checkpoint on disk is not FP8; the
    trainer syncs before step 1). Written for GPU, never run."""
    if rollout.quantization != "fp8":
        return {}
    from pacs_megatron.weight_sync.quantize import WeightQuantizer

    wq = WeightQuantizer(rollout.quantization, rollout.quant_recipe, rollout.quant_exclude)
    return {
        "quantization": "fp8",
        "hf_overrides": {"quantization_config": wq.vllm_quantization_config()},
        "load_format": "dummy",
    }


def refresh_fp8_layers(model) -> int:
    """Re-run vLLM's FP8 post-load processing on every FP8 linear layer after new weights + scales
    were loaded (the same step vLLM takes after reading a checkpoint). UNVERIFIED ON GPU: vLLM may
    replace processed parameters (losing their weight loaders), which verl and prime-rl patch around;
    the first GPU run must check that a second sync still loads. Returns the layers processed."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, Fp8LinearMethod):
            method.process_weights_after_loading(module)
            count += 1
    return count
