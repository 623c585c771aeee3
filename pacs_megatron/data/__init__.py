"""Prompts: the problems a run trains and validates on, as prompt records (the rows they become: batch/).

- ``sources``: read problem files (JSONL / JSON / parquet, plain or PACS format), name resolution;
- ``prompts``: PACS instruction, shipped chat templates, tokenizer loading, length filter;
- ``sampler``: :class:`PromptDataset`, a deterministic resumable prompt stream;
- ``synthetic``: the "a+b=" task, its character tokenizer and tiny-model directory;
- ``factory``: :func:`build_prompt_dataset`, what the trainer calls (``data:`` and a :class:`PromptRun`);
- ``routing``: MoE routing replay's per-row records of the experts the engine chose.
"""

from pacs_megatron.data.factory import (
    PromptRun,
    build_prompt_dataset,
    build_train_dataset,
    build_val_datasets,
    load_dataset,
)
from pacs_megatron.data.prompts import INSTRUCTION, load_tokenizer, with_instruction
from pacs_megatron.data.records import DataFormatError, Problem, PromptRecord
from pacs_megatron.data.sampler import PromptDataset
from pacs_megatron.data.sources import DATASETS, load_problems, resolve_dataset

__all__ = [
    "DATASETS",
    "INSTRUCTION",
    "DataFormatError",
    "Problem",
    "PromptDataset",
    "PromptRecord",
    "PromptRun",
    "build_prompt_dataset",
    "build_train_dataset",
    "build_val_datasets",
    "load_dataset",
    "load_problems",
    "load_tokenizer",
    "resolve_dataset",
    "with_instruction",
]
