"""What a vLLM engine holds after a weight sync, fingerprinted for the bitwise check (rollout/weight_checksum.py).

Runs inside the worker through ``LLM.apply_model`` (in-process under the external launcher). vLLM
transforms the HF tensors it loads, and each transform is undone by naming, not by copying:

    fused parameters   qkv_proj = [q; k; v], gate_up_proj = [gate; up] along dim 0 (the model's
                       ``packed_modules_mapping``): reported with their HF parts in order; the sender combines
                       the parts' checksums (``weight_checksum.combine``), so nothing fused is built on either side
    vocab padding      embedding and LM head rows beyond ``org_vocab_size``: cut off before fingerprinting
    CPU repacking      every linear (and the LM head) keeps only a packed copy for its GEMM kernel
                       (``dispatch_cpu_unquantized_gemm``; the parameter is emptied). It is read back
                       THROUGH THE KERNEL: ``quant_method.apply(layer, I)`` with an identity input gives
                       ``I @ W^T = W^T`` exactly (one product x * 1 per output, the rest exact zeros, in any
                       float format; a -0.0 weight comes back +0.0, which the checksum counts equal). What is
                       verified is thus the operand the kernel multiplies with, including the tied LM head's
                       own packed copy of the embedding that vLLM's reload once left stale
                       (vllm_reload.refresh_tied_lm_head).
    tied LM head       reported with the embedding as its one part

Not read back (the log-prob probe still covers them): FusedMoE experts (``w13_weight`` / ``w2_weight`` in
the CPU kernel's prepacked grouped layout; the router gate is a plain linear and is read back), and any
engine with tensor parallelism > 1 (each rank holds a shard: vllm_engine returns None). The identity costs
``2 K`` flops per weight of a K-input linear (docs/weight_sync.md gives the seconds).

GPU (never run): linears without ``cpu_linear`` are read as their parameters, which on GPU hold the
checkpoint layout for unquantized models; FP8 weights are not verified (vllm_engine returns None).
"""

from __future__ import annotations

import torch

from pacs_megatron.rollout.weight_checksum import Held, checksum, from_row_sums, row_sums

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


def held_checksums(model, dtype: torch.dtype) -> list[Held]:
    """Every tensor the model holds that maps to HF tensors, fingerprinted in ``dtype`` (the engine's)."""
    packed = getattr(model, "packed_modules_mapping", None) or {}
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    embed = next(
        (n for n, m in model.named_modules() if _is(m, "VocabParallelEmbedding") and not _is(m, "ParallelLMHead")),
        None,
    )
    out: list[Held] = []
    with torch.no_grad():
        for name, module in model.named_modules():
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
