"""Read problem files: the shared JSONL schema, JSON lists, and parquet (plain or PACS-formatted).

Accepted rows:

- plain: ``{"problem": str, "answer": str, "id"?: str, "source"?: str, ...}`` (JSONL, a JSON list, or
  parquet columns of those names); other fields are kept in ``Problem.extra``;
- PACS (ritzz-ai/PACS ``preprocess_dataset.py``): ``prompt`` = list of ``{role, content}`` messages
  (instruction already in the user turn), ``reward_model.ground_truth``, ``data_source``, ``extra_info``.

A bad row (not UTF-8, not JSON, not an object, a missing or empty field, a wrong type) raises
:class:`DataFormatError` naming file, line and field with ``bad_records="error"``, or is skipped and
counted with ``"skip"``. Names of the shared sets resolve against the data root (see :data:`DATASETS`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pacs_megatron.data.records import DataFormatError, Problem
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

DATASETS: dict[str, str] = {
    "math500": "eval/math500.jsonl",
    "aime2024": "eval/aime2024.jsonl",
    "aime2025": "eval/aime2025.jsonl",
    "amc23": "eval/amc23.jsonl",
    "gsm8k_test": "eval/gsm8k_test.jsonl",
    "math_train": "train/math_train.jsonl",
    "deepscaler_subset803": "train/deepscaler_subset803.jsonl",
    "aime_1983_2023": "train/aime_1983_2023.jsonl",
    "gsm8k_train": "train/gsm8k_train.jsonl",
}
"""Names of the shared sets -> path under the data root (``DataConfig.resolved_root()``)."""

SUFFIXES = (".jsonl", ".json", ".parquet")


def resolve_dataset(name_or_path: str, root: str | Path) -> tuple[str, Path]:
    """``(dataset name, file)`` of a shared-set name or a file path (name = file stem).

    Example:
        >>> DATASETS["math500"]  # resolve_dataset("math500", root) -> ("math500", root / this)
        'eval/math500.jsonl'
    """
    if name_or_path in DATASETS:
        path = Path(root) / DATASETS[name_or_path]
        if not path.is_file():
            raise FileNotFoundError(
                f"dataset {name_or_path!r}: {path} does not exist; set data.data_root (or $PACS_DATA_ROOT) to the "
                "folder holding eval/ and train/"
            )
        return name_or_path, path
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset {name_or_path!r} is neither a known name ({sorted(DATASETS)}) nor an existing file"
        )
    if path.suffix not in SUFFIXES:
        raise DataFormatError(f"dataset file {path}: unsupported suffix {path.suffix!r}; use one of {SUFFIXES}")
    return path.stem, path


def load_problems(path: str | Path, bad_records: str = "error", source: str | None = None) -> list[Problem]:
    """All well-formed problems of ``path`` in file order (``bad_records``: "error" or "skip")."""
    path = Path(path)
    source = source or path.stem
    problems, skipped, first_error = [], 0, None
    for where, row in _rows(path):
        try:
            if isinstance(row, DataFormatError):
                raise row
            problems.append(_parse(row, where, path, source))
        except DataFormatError as e:
            if bad_records != "skip":
                raise
            skipped += 1
            first_error = first_error or str(e)
    if skipped:
        logger.warning("%s: skipped %d malformed rows (data.bad_records=skip); first: %s", path, skipped, first_error)
    if not problems:
        raise DataFormatError(f"dataset file {path}: no usable rows")
    return problems


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(location, row or DataFormatError)`` for every row of the file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"row {i}", row
    elif path.suffix == ".json":
        raw = path.read_bytes()
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise DataFormatError(_not_utf8(path, line, raw[e.start], e.start - raw.rfind(b"\n", 0, e.start))) from None
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, list):
            raise DataFormatError(f"{path}: a .json dataset must be a list of objects (or use .jsonl)")
        for i, row in enumerate(data, start=1):
            yield f"item {i}", row
    else:
        with open(path, "rb") as f:  # bytes: a byte that is not UTF-8 is named with its line, not a traceback
            for i, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield f"line {i}", DataFormatError(_not_utf8(path, i, raw[e.start], e.start + 1))
                    continue
                if not line.strip():
                    continue
                try:
                    yield f"line {i}", json.loads(line)
                except json.JSONDecodeError as e:
                    yield f"line {i}", DataFormatError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})")


def _not_utf8(path: Path, line: int, byte: int, column: int) -> str:
    return (
        f"{path}:{line}: byte 0x{byte:02x} at column {column} is not UTF-8: re-save the file as UTF-8 "
        "(e.g. iconv -f latin1 -t utf-8), or fix that line"
    )


def _field(row: dict, key: str, where: str, path: Path, required: bool = True) -> Any:
    value = row.get(key)
    if value is None:
        if required:
            raise DataFormatError(f"{path} {where}: missing field {key!r} (have {sorted(row)})")
        return None
    if not isinstance(value, str):
        raise DataFormatError(
            f"{path} {where}: field {key!r} must be a string, got {type(value).__name__} {value!r:.60}"
        )
    if required and not value.strip():
        raise DataFormatError(f"{path} {where}: field {key!r} is empty")
    return value


def _parse(row: Any, where: str, path: Path, source: str) -> Problem:
    if not isinstance(row, dict):
        raise DataFormatError(f"{path} {where}: expected a JSON object, got {type(row).__name__}")
    default_id = f"{source}-{where.split()[-1]}"
    if "prompt" in row and "problem" not in row:
        return _parse_pacs(row, where, path, source, default_id)
    problem = _field(row, "problem", where, path)
    answer = _field(row, "answer", where, path)
    rid = _field(row, "id", where, path, required=False) or default_id
    src = _field(row, "source", where, path, required=False) or source
    extra = {k: v for k, v in row.items() if k not in ("problem", "answer", "id", "source")}
    return Problem(id=rid, problem=problem, answer=answer, source=src, extra=extra)


def _parse_pacs(row: dict, where: str, path: Path, source: str, default_id: str) -> Problem:
    messages = row["prompt"]
    if not isinstance(messages, list) or not messages:
        raise DataFormatError(f"{path} {where}: field 'prompt' must be a non-empty list of {{role, content}} messages")
    parsed = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataFormatError(f"{path} {where}: field 'prompt[{j}]' must be {{'role': str, 'content': str}}")
        parsed.append((m["role"], m["content"]))
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict):
        raise DataFormatError(f"{path} {where}: missing field 'reward_model.ground_truth'")
    answer = _field(reward_model, "ground_truth", where, path)
    users = [c for r, c in parsed if r == "user"]
    if not users:
        raise DataFormatError(f"{path} {where}: field 'prompt' has no user message")
    info = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    rid = f"{source}-{info['index']}" if isinstance(info.get("index"), int) else default_id
    src = row.get("data_source") if isinstance(row.get("data_source"), str) else source
    extra = {k: v for k, v in row.items() if k not in ("prompt", "reward_model")}
    return Problem(id=rid, problem=users[-1], answer=answer, source=src, messages=tuple(parsed), extra=extra)
