"""Loading the actor's full Hugging Face-named tensors into a vLLM engine: vLLM's layerwise reload.

    buckets of (hf_name, full tensor) --SyncStream.tensors--> one checked stream of tensors
        --LLM.collective_rpc("reload_weights", weights_iterator=...)-->  on each local worker:
            restore every layer to its checkpoint layout (meta), load (vLLM narrows to its TP rank and
            fuses q/k/v and gate/up), re-run the post-load processing (CPU repacking, FP8 scales), copy
            the result into the original storage
        --refresh_tied_lm_head--> (CPU) rebuild the tied LM head's packed copy of the embedding
        --reset_prefix_cache-->   no KV computed with the old weights is reused

Why the reload and not ``model.load_weights``: after loading, vLLM may rewrite parameters into a kernel
layout. On CPU every linear weight is repacked and the parameter emptied
(``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so a second ``load_weights`` fails
(``'Parameter' object has no attribute 'weight_loader'``); FP8 and some MoE backends do the same on GPU.
The reload is vLLM 0.32's supported path for all of them, so CPU and GPU share it.

A partial sync is an error, not a silently half-updated policy: :class:`SyncStream` checks every name
against a Hugging Face checkpoint of the model (the expected names come from the model's transformers
class, instantiated on the meta device: no memory, no weights), refuses unknown and repeated names as
they stream, and raises after the reload naming the tensors that never arrived (vLLM itself only logs a
warning and keeps the old weights of layers it received nothing for). Names that only alias another
tensor (``lm_head.weight`` with tied embeddings) are optional and dropped. The post-sync probe
(weight_sync/sync.py) then checks the numbers. The sending side (gather, buckets, quantization) is weight_sync/.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from pacs_megatron.rollout.weight_checksum import Held, checksum, from_row_sums, row_sums
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

NamedTensor = tuple[str, torch.Tensor]


def expected_hf_names(model_dir: str | Path) -> tuple[frozenset[str], frozenset[str]] | None:
    """``(required, optional)`` tensor names of a Hugging Face checkpoint of ``model_dir``'s model.

    Required: parameters and persistent buffers; optional: state-dict names that alias one of them
    (tied LM head). None when transformers cannot build the model class (then only the probe checks).

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
    except Exception as e:  # an architecture transformers does not know: the probe still checks
        logger.warning("vLLM weight sync: cannot list the HF tensor names of %s (%s); probe only", model_dir, e)
        return None
    params = {n for n, _ in model.named_parameters()}
    params |= {n for n, b in model.named_buffers() if n in model.state_dict()}
    optional = set(model.state_dict()) - params
    shapes = dict(model.named_parameters())
    required = {c for n in params for c in checkpoint_names(n, shapes[n].shape[0] if n in shapes else 0)}
    return frozenset(required), frozenset(optional)


_FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def checkpoint_names(name: str, leading: int) -> list[str]:
    """The checkpoint tensor names behind one transformers parameter: itself, or for a fused MoE expert
    parameter (transformers 5 keeps ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``
    in memory; ``leading`` is its E) the per-expert names checkpoints, the actor's export and vLLM's
    Qwen3-MoE loader use: one missing expert is then named, not hidden inside a fused tensor.

    Example:
        >>> [n.split("experts.")[1] for n in checkpoint_names("model.layers.0.mlp.experts.gate_up_proj", 2)]
        ['0.gate_proj.weight', '0.up_proj.weight', '1.gate_proj.weight', '1.up_proj.weight']
        >>> checkpoint_names("model.norm.weight", 64)
        ['model.norm.weight']
    """
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".mlp.experts") or leaf not in _FUSED_EXPERTS:
        return [name]
    return [f"{prefix}.{e}.{proj}.weight" for e in range(leading) for proj in _FUSED_EXPERTS[leaf]]


class SyncStream:
    """One sync's checked stream of tensors (make one per sync).

    Example:
        >>> s = SyncStream((frozenset({"a", "b"}), frozenset({"tied"})))
        >>> [n for n, _ in s.tensors([[("a", torch.zeros(1)), ("tied", torch.zeros(1))], [("b", torch.ones(1))]])]
        ['a', 'b']
        >>> s.finish()
        2
    """

    def __init__(
        self, expected: tuple[frozenset[str], frozenset[str]] | None, scale_suffixes: tuple[str, ...] = ()
    ) -> None:
        """``scale_suffixes``: extra names ``<required name><suffix>`` accepted (FP8 scales, see
        weight_sync/quantize.py: ``("_scale", "_scale_inv")``)."""
        self.required: frozenset[str] | None
        self.optional: frozenset[str]
        self.required, self.optional = expected if expected is not None else (None, frozenset())
        self.scale_suffixes = scale_suffixes
        self.received: set[str] = set()

    def _known(self, name: str) -> bool:
        required = self.required or frozenset()  # None: no expected names (tensors() does not ask then)
        if name in required or name in self.optional:
            return True
        return any(name.endswith(s) and name[: -len(s)] in required for s in self.scale_suffixes)

    def tensors(self, buckets: Iterable[Iterable[NamedTensor]]) -> Iterator[NamedTensor]:
        """The buckets' tensors in order, checked; optional aliases dropped. Raises ``KeyError`` on a name
        the checkpoint format does not have, ``ValueError`` on a name sent twice (before yielding it)."""
        for bucket in buckets:
            for name, tensor in bucket:
                if self.required is not None and not self._known(name):
                    raise KeyError(f"vLLM weight sync: {name!r} is not a tensor of this model's HF checkpoint")
                if name in self.received:
                    raise ValueError(f"vLLM weight sync: {name!r} sent twice")
                self.received.add(name)
                if name not in self.optional:
                    yield name, tensor

    def finish(self) -> int:
        """After the stream was consumed: the number of tensors loaded; raises ``RuntimeError`` naming the
        HF tensors that never arrived (a partial sync)."""
        if self.required is not None:
            missing = sorted(self.required - self.received)
            if missing:
                raise RuntimeError(
                    f"vLLM weight sync: {len(missing)} HF tensors never arrived (partial sync; the engine now "
                    f"mixes old and new weights): {missing[:8]}{' ...' if len(missing) > 8 else ''}"
                )
        return len(self.received - self.optional)


def refresh_tied_lm_head(model) -> bool:
    """vLLM 0.32 CPU workaround: after a reload, rebuild the tied LM head's packed weight.

    On CPU, ``ParallelLMHead`` keeps its own packed copy of the weight (``cpu_linear``, made by
    ``dispatch_cpu_unquantized_gemm``) even when it is tied to the embedding. The reload receives no
    tensor for a tied head (the checkpoint has none), so vLLM puts the head's old state back and its packed
    copy keeps the OLD embedding: logits 1.4 nats off after moving the weights (measured; minimal
    reproduction in docs/weight_sync.md). Re-running the dispatch without removing the (shared, freshly
    loaded) weight rebuilds it. Returns whether anything was rebuilt (False on GPU and for untied heads)."""
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if head is None or not hasattr(head, "cpu_linear") or not getattr(config, "tie_word_embeddings", False):
        return False
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return True


def repack_cpu_moe_experts(model) -> int:
    """vLLM 0.32 CPU workaround: after a reload, re-run the CPU MoE kernel's prepack of the experts.

    vLLM's CPU MoE kernel (``CPUUnquantizedExperts``) keeps ``w13_weight`` / ``w2_weight`` in a prepacked
    grouped-GEMM layout (``cpu_prepack_moe_weight``) made once, at the first load. On a reload
    ``UnquantizedFusedMoEMethod._setup_kernel`` sees a kernel already built and skips that prepack (it only
    copies the new weights into the old storage), so the kernel reads HF-layout weights as packed ones:
    log-probs ~1.8 nats off after one sync of a tiny Qwen3-MoE (measured). Packing the freshly loaded
    weights into the same storage fixes it. Only after a complete reload: a layer that received nothing keeps
    its packed tensors, and packing them twice would scramble them. Returns the number of MoE layers
    repacked (0 on GPU and for dense models). An intermediate size vLLM pads at load (not a multiple of the
    kernel's alignment, 32) makes the reload's copy fail on shapes before this runs."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without the CPU MoE kernels (GPU)
        return 0
    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        with torch.no_grad():
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(module, name)
                weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        count += 1
    return count


def _repack_after_reload(model) -> tuple[bool, int]:
    return refresh_tied_lm_head(model), repack_cpu_moe_experts(model)


def reload_weights(llm, buckets: Iterable[Iterable[NamedTensor]], stream: SyncStream) -> int:
    """Load ``buckets`` into ``llm`` (a ``vllm.LLM`` under the external launcher) through vLLM's layerwise
    reload, fix what the reload leaves stale on CPU (tied head, MoE prepack), reset the prefix cache; return
    the number of tensors loaded."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream.tensors(buckets)})
    count = stream.finish()
    llm.apply_model(_repack_after_reload)
    llm.reset_prefix_cache()
    return count


# ------------------------------------------------------------------------------ the bitwise check's read-back
#
# What the engine holds after a sync, fingerprinted for the bitwise check (rollout/weight_checksum.py). Runs
# inside the worker through ``LLM.apply_model`` (in-process under the external launcher). vLLM transforms the
# HF tensors it loads, and each transform is undone by naming, not by copying:
#
#     fused parameters   qkv_proj = [q; k; v], gate_up_proj = [gate; up] along dim 0 (the model's
#                        ``packed_modules_mapping``): reported with their HF parts in order; the sender combines
#                        the parts' checksums (``weight_checksum.combine``): nothing fused is built on either side
#     vocab padding      embedding and LM head rows beyond ``org_vocab_size``: cut off before fingerprinting
#     CPU repacking      every linear (and the LM head) keeps only a packed copy for its GEMM kernel
#                        (``dispatch_cpu_unquantized_gemm``; the parameter is emptied). It is read back
#                        THROUGH THE KERNEL: ``quant_method.apply(layer, I)`` with an identity input gives
#                        ``I @ W^T = W^T`` exactly (one product x * 1 per output, the rest exact zeros, in any
#                        float format; a -0.0 weight comes back +0.0, which the checksum counts equal). What is
#                        verified is thus the operand the kernel multiplies with, including the tied LM head's
#                        own packed copy of the embedding that vLLM's reload once left stale
#                        (refresh_tied_lm_head above).
#     tied LM head       reported with the embedding as its one part
#     LoRA wrappers      with ``enable_lora`` (sync.lora=adapter) vLLM wraps each adapted linear X in a
#                        ``...WithLoRA`` module around ``X.base_layer``: the wrapper is skipped (it forwards to
#                        its base) and the base is reported under X's name. The adapters themselves are the
#                        probe's (rollout/vllm/lora.py)
#
# Not read back (the log-prob probe still covers them): FusedMoE experts (``w13_weight`` / ``w2_weight`` in
# the CPU kernel's prepacked grouped layout; the router gate is a plain linear and is read back), and any
# engine with tensor parallelism > 1 (each rank holds a shard: vllm_engine returns None). The identity costs
# ``2 K`` flops per weight of a K-input linear (docs/weight_sync.md gives the seconds).
#
# GPU (never run): linears without ``cpu_linear`` are read as their parameters, which on GPU hold the
# checkpoint layout for unquantized models; FP8 weights are not verified (vllm_engine returns None).

EYE_ROWS = 256
"""Rows of the identity fed per kernel call: bounds the read-back's temporary to 256 x the layer's outputs."""


def _is(module, cls: str) -> bool:
    return any(c.__name__ == cls for c in type(module).__mro__)


def _read_through_kernel(module, inputs: int, dtype: torch.dtype) -> torch.Tensor:
    """``[outputs]`` row sums of the weight the module's GEMM kernel multiplies with (module docstring)."""
    total = None
    for start in range(0, inputs, EYE_ROWS):
        rows = min(EYE_ROWS, inputs - start)
        eye = torch.zeros(rows, inputs, dtype=dtype)
        eye[:, start : start + rows] = torch.eye(rows, dtype=dtype)
        out = module.quant_method.apply(module, eye)  # [rows, outputs] = W[:, start:start+rows]^T
        part = row_sums(out.t())
        total = part if total is None else total + part
    return total


_LORA_BASE = ".base_layer"
"""What vLLM's LoRA wrappers call the linear they wrap (``qkv_proj.base_layer``)."""


def _is_lora_wrapper(module) -> bool:
    """A vLLM LoRA layer around a base layer (it forwards attribute look-ups to it: read the base instead)."""
    return type(module).__name__.endswith("WithLoRA") and hasattr(module, "base_layer")


def held_checksums(model, dtype: torch.dtype) -> list[Held]:
    """Every tensor the model holds that maps to HF tensors, fingerprinted in ``dtype`` (the engine's)."""
    packed = getattr(model, "packed_modules_mapping", None) or {}
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    modules = [(n.replace(_LORA_BASE, ""), m) for n, m in model.named_modules() if not _is_lora_wrapper(m)]
    embed = next(
        (n for n, m in modules if _is(m, "VocabParallelEmbedding") and not _is(m, "ParallelLMHead")),
        None,
    )
    out: list[Held] = []
    with torch.no_grad():
        for name, module in modules:
            if _is(module, "FusedMoE"):
                continue  # prepacked grouped experts: probe only (module docstring)
            prefix, _, leaf = name.rpartition(".")
            prefix = prefix + "." if prefix else ""
            vocab = getattr(module, "org_vocab_size", None) if _is(module, "VocabParallelEmbedding") else None
            head = _is(module, "ParallelLMHead")
            linear = head or hasattr(module, "input_size_per_partition")
            through_kernel = linear and hasattr(module, "cpu_linear") and hasattr(module, "quant_method")

            def parts(param: str, leaf=leaf, prefix=prefix, name=name, head=head) -> tuple[str, ...]:
                if head and tied and param == "weight" and embed is not None:
                    return (f"{embed}.weight",)
                if leaf in packed:
                    return tuple(f"{prefix}{sub}.{param}" for sub in packed[leaf])
                return (f"{name}.{param}",)

            if through_kernel:
                inputs = module.embedding_dim if head else module.input_size_per_partition
                sums = _read_through_kernel(module, int(inputs), dtype)
                out.append(Held(f"{name}.weight", parts("weight"), from_row_sums(sums[:vocab] if vocab else sums)))
            for param, tensor in module.named_parameters(recurse=False):
                if (through_kernel and param == "weight") or tensor.numel() == 0:
                    continue
                if vocab is not None and param == "weight":
                    tensor = tensor[:vocab]
                out.append(Held(f"{name}.{param}", parts(param), checksum(tensor, dtype)))
    return out
