"""The trainer's one entry to data: the train stream and the validation sets of ``data:``.

    train = build_prompt_dataset(data, tokenizer, "train", run)   # PromptDataset (next_batch, state_dict)
    val   = build_prompt_dataset(data, tokenizer, "val", run)     # {"math500": [PromptRecord, ...], ...}

``run`` (:class:`PromptRun`) is what the factory reads of the rest of the run: the prompts' tools and the
validation sets' cut (loop/build.py ``prompt_run`` picks them out of a run config; default: none, all).

``data.task="math"`` reads ``data.train_files`` / ``data.val_files`` (names of the shared sets or file
paths) with the PACS instruction and ``data.chat_template``; ``"arith"`` builds the synthetic task
(raw "3+5=" prompts, or math problems in words; train and validation are its whole problem set,
validation keyed ``"arith"``; with ``data.arith.test_fraction`` the split's train part and held-out
part, keyed ``"arith_heldout"``, and with ``data.arith.val_fraction`` a disjoint validation part, keyed
``"arith_val"``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pacs_megatron.data.prompts import build_records, row_tools, tokenize_prompts
from pacs_megatron.data.records import DataFormatError, PromptRecord
from pacs_megatron.data.sampler import PromptDataset
from pacs_megatron.data.sources import load_problems, resolve_dataset
from pacs_megatron.data.synthetic import arith_split, arith_splits
from pacs_megatron.utils.logging import get_logger

if TYPE_CHECKING:
    from pacs_megatron.config import DataConfig
    from pacs_megatron.config.tools import ToolsConfig

logger = get_logger(__name__)


@dataclass(frozen=True)
class PromptRun:
    """What the data factory reads of a run beyond ``data:``; the default is a single-turn run's, every row.

    Example:
        >>> PromptRun().instruction, PromptRun().tools, PromptRun(val_sets=("math500",)).val_sets
        ('', None, ('math500',))
    """

    instruction: str = ""
    """``rollout.multi_turn.instruction`` when rollouts call tools: every user prompt ends with it; else ""."""
    tools: ToolsConfig | None = None
    """``tools:`` when rollouts call tools: the tools a row's ``tools`` list may name; None: single-turn, whose
    rows' ``tools`` field is never read (a column of that name may mean something else there)."""
    val_max_problems: int = 0
    """``trainer.val_max_problems``: each validation set's first rows; 0: all."""
    val_sets: tuple[str, ...] = ()
    """``trainer.val_sets``: only these validation sets; empty: all."""


def load_dataset(
    name_or_path: str, data: DataConfig, tokenizer, limit: int = 0, suffix: str = ""
) -> tuple[str, list[PromptRecord]]:
    """``(name, records)`` of one math set: read, render, tokenize, filter; the first ``limit`` if > 0;
    ``suffix`` ends each user prompt (:attr:`PromptRun.instruction`)."""
    name, path = resolve_dataset(name_or_path, data.resolved_root())
    problems = load_problems(path, data.bad_records, source=name)
    if limit:
        problems = problems[:limit]
    records = build_records(
        problems, tokenizer, data.chat_template, data.max_prompt_length, data.overlong_prompts, name, data.shots, suffix
    )
    logger.info("dataset %s: %d prompts from %s", name, len(records), path)
    return name, records


def check_row_tools(records: list[PromptRecord], tools: ToolsConfig | None, name: str) -> list[PromptRecord]:
    """``records`` with the tools each row may call (its ``tools`` list: the task definition of which tools its
    prompt may call), once every name is one ``tools`` enables; else one line naming the row, the tool and the
    fix. Single-turn runs (``tools`` None) never read the field (a column of that name may mean something else)."""
    if tools is None:
        return records
    enabled, out = tools.names, []
    for rec in records:
        named = row_tools(rec)
        unknown = [t for t in named or () if t not in enabled]
        if unknown:
            raise DataFormatError(
                f"dataset {name}: problem {rec.id!r} may call tools {unknown}, which this run does not enable "
                f"(tools.enabled={list(tools.enabled)}): enable them, or drop them from the row's tools list"
            )
        out.append(replace(rec, tools=named))
    return out


def arith_prompt_records(problems, data: DataConfig, tokenizer, name: str, suffix: str = "") -> list[PromptRecord]:
    """The synthetic task's records, through the same ``data.max_prompt_length`` /
    ``data.overlong_prompts`` check as every other source of prompts: the raw problem text is the
    prompt, or (``data.arith.style=words``) the problem is rendered as a math problem (instruction and
    ``data.chat_template``)."""
    if data.arith.style == "words":
        return build_records(
            problems,
            tokenizer,
            data.chat_template,
            data.max_prompt_length,
            data.overlong_prompts,
            name,
            data.shots,
            suffix,
        )
    texts = [f"{p.problem} {suffix}" if suffix else p.problem for p in problems]
    return tokenize_prompts(problems, texts, tokenizer, data.max_prompt_length, data.overlong_prompts, name)


def build_train_dataset(data: DataConfig, tokenizer, run: PromptRun = PromptRun()) -> PromptDataset:
    """The train stream of ``data`` (all train files concatenated, shuffled per epoch), with ``run``'s tools."""
    if data.task == "arith":
        arith = arith_prompt_records(arith_split(data.arith)[0], data, tokenizer, "arith", run.instruction)
        return PromptDataset(arith, data.seed, data.shuffle, name="arith")
    records: list[PromptRecord] = []
    names = []
    for f in data.train_files:
        name, recs = load_dataset(f, data, tokenizer, suffix=run.instruction)
        records.extend(check_row_tools(recs, run.tools, name))
        names.append(name)
    return PromptDataset(records, data.seed, data.shuffle, name="+".join(names))


def build_val_datasets(data: DataConfig, tokenizer, run: PromptRun = PromptRun()) -> dict[str, list[PromptRecord]]:
    """Validation sets of ``data`` by name, each capped at ``run.val_max_problems`` (first rows; 0: all), only those
    ``run.val_sets`` names when it names any (ValueError naming the field for a set the run has not)."""
    sets = _val_datasets(data, tokenizer, run)
    wanted = run.val_sets
    missing = [n for n in wanted if n not in sets]
    if missing:
        raise ValueError(
            f"trainer.val_sets names {missing}, which this run does not have: choose from {sorted(sets)} "
            "(or trainer.val_sets=[] for all)"
        )
    return {k: v for k, v in sets.items() if k in wanted} if wanted else sets


def _val_datasets(data: DataConfig, tokenizer, run: PromptRun) -> dict[str, list[PromptRecord]]:
    limit, suffix = run.val_max_problems, run.instruction
    if data.task == "arith":
        splits = arith_splits(data.arith)
        name = "arith_heldout" if data.arith.test_fraction else "arith"  # held-out problems only
        sets = {name: arith_prompt_records(splits["test"], data, tokenizer, name, suffix)}
        if splits["val"]:  # the validation split (tuning), disjoint from the held-out one
            sets["arith_val"] = arith_prompt_records(splits["val"], data, tokenizer, "arith_val", suffix)
        return {k: v[:limit] if limit else v for k, v in sets.items()}
    out: dict[str, list[PromptRecord]] = {}
    for f in data.val_files:
        name, recs = load_dataset(f, data, tokenizer, limit, suffix)
        if name in out:
            raise ValueError(f"data.val_files names {name!r} twice")
        out[name] = check_row_tools(recs, run.tools, name)
    return out


def build_prompt_dataset(data: DataConfig, tokenizer, split: str = "train", run: PromptRun = PromptRun()):
    """``split="train"``: :func:`build_train_dataset`; ``"val"``: :func:`build_val_datasets`."""
    if split == "train":
        return build_train_dataset(data, tokenizer, run)
    if split == "val":
        return build_val_datasets(data, tokenizer, run)
    raise ValueError(f"split={split!r}: use 'train' or 'val'")
