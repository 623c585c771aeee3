"""Quantized rollouts: the actor's exported weights pass through nvidia-modelopt's own quantizers at the sync.

The actor trains in its own dtype; only the stream handed to the engine is quantized::

    actor.export_hf_weights()                      (hf_name, full tensor), one at a time
      2-D ``*.weight`` not in rollout.quant_exclude  -> modelopt TensorQuantizer of the recipe's weight quantizer
          HF engine : fake quant (quantize-dequantize, in the tensor's dtype): the FP8 numerics on any device
          vLLM      : real quant -> (name, float8_e4m3fn data) + (name + "_scale[_inv]", float32 scales)
      anything else (embeddings, LM head, norms, biases) -> unchanged

The quantizer is modelopt's ``TensorQuantizer`` built from the ``*weight_quantizer`` entry of a named
recipe (``modelopt.torch.quantization.config.<RECIPE>``): FP8_DEFAULT_CFG is one E4M3 scale per tensor
(amax / 448), FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG one per 128x128 block, FP8_PER_CHANNEL_PER_TOKEN_CFG one
per output row. No rounding is written here. A fresh quantizer per tensor has no calibrated amax, so
modelopt takes the tensor's own max ("max" calibration of a weight, which is what a weight-only export
does). modelopt is imported lazily (several seconds): only a run with ``rollout.quantization != none``
pays for it.

The vLLM stream (``fp8_stream``) is written for GPU and has never run: see docs/fp8.md.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

NamedTensor = tuple[str, torch.Tensor]

AUTO_RECIPES = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
_NUM_BITS = {"fp8": (4, 3), "nvfp4": (2, 1)}


def modelopt_available() -> bool:
    """Whether ``modelopt.torch.quantization`` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("modelopt.torch.quantization") is not None
    except ModuleNotFoundError:
        return False


def _recipes():
    # Lazy: only quantized runs import modelopt. modelopt.torch imports its distill package, which imports TRL
    # where it is installed, and TRL's import sets VLLM_LOGGING_LEVEL=ERROR when unset (trl/_compat.py): every
    # vLLM engine this process or its children start then dropped vLLM's warnings. vLLM's own default (INFO)
    # stands in during the import, and the variable is left as it was found.
    unset = "VLLM_LOGGING_LEVEL" not in os.environ
    if unset:
        os.environ["VLLM_LOGGING_LEVEL"] = "INFO"
    try:
        import modelopt.torch.quantization.config as mtq_config
    finally:
        if unset:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
    return mtq_config


def resolve_recipe(mode: str, recipe: str) -> str:
    """The modelopt recipe name ``rollout.quant_recipe`` means for ``rollout.quantization=mode``."""
    return AUTO_RECIPES[mode] if recipe == "auto" else recipe


def weight_quantizer_cfg(recipe: str) -> dict[str, Any]:
    """The attribute config of a recipe's ``*weight_quantizer`` (its last entry wins, as modelopt applies
    the entries in order). Raises ``KeyError`` for a name modelopt does not know.

    Example:
        >>> weight_quantizer_cfg("FP8_DEFAULT_CFG")  # doctest: +SKIP
        {'num_bits': (4, 3), 'axis': None}
    """
    mtq_config = _recipes()
    if recipe not in mtq_config.choices:
        raise KeyError(recipe)
    entries = getattr(mtq_config, recipe)["quant_cfg"]
    if isinstance(entries, dict):  # older modelopt: {pattern: cfg}
        entries = [{"quantizer_name": k, "cfg": v} for k, v in entries.items()]
    found = None
    for entry in entries:
        if entry.get("quantizer_name") == "*weight_quantizer" and entry.get("cfg"):
            found = dict(entry["cfg"])
    if found is None:
        raise KeyError(f"{recipe} has no '*weight_quantizer' entry")
    return found


def _bits(cfg: dict[str, Any]):
    bits = cfg.get("num_bits")
    return tuple(bits) if isinstance(bits, (list, tuple)) else bits


def recipes_for(mode: str) -> list[str]:
    """The modelopt recipes whose weight quantizer has ``rollout.quantization=mode``'s format."""
    out = []
    for name in sorted(_recipes().choices):
        try:
            if _bits(weight_quantizer_cfg(name)) == _NUM_BITS[mode]:
                out.append(name)
        except KeyError:  # KV-cache-only recipes have no weight quantizer
            continue
    return out


def check_recipe(mode: str, recipe: str) -> str | None:
    """Why ``(rollout.quantization, rollout.quant_recipe)`` cannot be used, or None. Imports modelopt."""
    name = resolve_recipe(mode, recipe)
    try:
        cfg = weight_quantizer_cfg(name)
    except KeyError:
        return (
            f"rollout.quant_recipe={recipe!r} is not a modelopt {mode.upper()} recipe: use 'auto' or one of "
            f"{recipes_for(mode)}"
        )
    if _bits(cfg) != _NUM_BITS[mode]:
        return (
            f"rollout.quant_recipe={name!r} quantizes weights to num_bits={cfg.get('num_bits')}, not "
            f"rollout.quantization={mode!r}: pick a {mode.upper()} recipe or quant_recipe=auto"
        )
    return None


class WeightQuantizer:
    """Quantizes the selected tensors of a weight stream with one modelopt recipe.

    Example:
        >>> wq = WeightQuantizer("fp8", "auto", ["*embed_tokens*", "*lm_head*"])  # doctest: +SKIP
        >>> dict(wq.dequantized_stream(actor.export_hf_weights()))  # doctest: +SKIP
    """

    def __init__(self, mode: str, recipe: str, exclude: Sequence[str] = ()) -> None:
        self.mode = mode
        self.recipe = resolve_recipe(mode, recipe)
        self.attr_cfg = weight_quantizer_cfg(self.recipe)
        self.exclude = tuple(exclude)

    def selects(self, name: str, tensor: torch.Tensor) -> bool:
        """Only the matrices of linear layers: 2-D floating ``*.weight`` tensors not excluded by pattern."""
        return (
            tensor.ndim == 2
            and tensor.is_floating_point()
            and name.endswith(".weight")
            and not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)
        )

    def _quantizer(self, fake: bool):
        from modelopt.torch.quantization.config import QuantizerAttributeConfig
        from modelopt.torch.quantization.nn import TensorQuantizer

        return TensorQuantizer(QuantizerAttributeConfig(**{**self.attr_cfg, "fake_quant": fake}))

    @torch.no_grad()
    def fake_quantize(self, tensor: torch.Tensor) -> torch.Tensor:
        """modelopt's quantize-dequantize of one tensor (same shape and dtype)."""
        return self._quantizer(fake=True)(tensor)

    @torch.no_grad()
    def real_quantize(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(quantized data, float32 dequantization scales)`` from modelopt's real quantization:
        ``tensor ~= data * scale`` (per tensor: a scalar; per 2-D block: ``[rows/b, cols/b]``)."""
        q = self._quantizer(fake=False)
        qtensor = q(tensor)
        return qtensor._quantized_data, q._scale.float()

    def dequantized_stream(self, stream: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
        """The stream with every selected tensor replaced by its quantize-dequantize (what an engine
        without FP8 kernels must hold to sample from exactly the FP8 policy)."""
        for name, tensor in stream:
            yield name, self.fake_quantize(tensor) if self.selects(name, tensor) else tensor

    def fp8_stream(self, stream: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
        """For vLLM's FP8 linear method (written for GPU, never run): each selected ``x.weight`` becomes
        ``x.weight`` (float8_e4m3fn) and ``x.weight_scale_inv`` (128x128 block scales, DeepSeek/Qwen FP8
        checkpoint names) or ``x.weight_scale`` (one scale per tensor); vLLM's loader shards and fuses
        them as it does for an FP8 checkpoint."""
        blocked = bool(self.attr_cfg.get("block_sizes"))
        for name, tensor in stream:
            if not self.selects(name, tensor):
                yield name, tensor
                continue
            data, scale = self.real_quantize(tensor)
            yield name, data
            yield name + ("_scale_inv" if blocked else "_scale"), scale if blocked else scale.reshape(())

    def vllm_quantization_config(self) -> dict[str, Any]:
        """``hf_overrides["quantization_config"]`` telling vLLM the pushed weights are an FP8 checkpoint
        (dynamic activation scales; block size when the recipe is blockwise). Never run."""
        block = self.attr_cfg.get("block_sizes") or {}
        out: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if block:
            out["weight_block_size"] = [
                int(block[-2] if -2 in block else block[0]),
                int(block[-1] if -1 in block else block[1]),
            ]
        return out


def vllm_fp8_config(rollout) -> dict[str, Any] | None:
    """What the vLLM engine must be built with (``build_engine(..., fp8_config=...)``) to load the FP8 weights
    this sync sends (``rollout.quantization=fp8`` with ``rollout.engine=vllm``): vLLM's ``quantization_config``
    of the recipe (:meth:`WeightQuantizer.vllm_quantization_config`); None for any other run. The engine
    never reads the recipe itself: the sender describes what it sends. Imports modelopt only for FP8."""
    if rollout.quantization != "fp8" or rollout.engine != "vllm":
        return None
    return WeightQuantizer(rollout.quantization, rollout.quant_recipe, rollout.quant_exclude).vllm_quantization_config()
