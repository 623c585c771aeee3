"""Records that cross the data boundary: a problem as read from a file, and a prompt ready to roll out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class DataFormatError(ValueError):
    """A dataset row is malformed; the message names the file, the line (or row) and the field."""


@dataclass(frozen=True)
class Problem:
    """One problem as stored in a dataset file, before any prompt formatting.

    Example:
        >>> Problem(id="math500-000", problem="What is $1+1$?", answer="2", source="math500").messages
    """

    id: str
    """Unique within its file (``math500-017``); files without ids get ``<file stem>-<line>``."""
    problem: str
    """The problem statement, without instruction or template."""
    answer: str
    """Short ground-truth answer (what the verifier compares against)."""
    source: str
    """Dataset name (``math500``, ``gsm8k_train``, ``arith``, ...)."""
    messages: tuple[tuple[str, str], ...] | None = None
    """(role, content) chat messages when the file already holds a formatted prompt (the PACS parquet
    format, instruction included); None for plain ``problem`` rows."""
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """Every other field of the row (``solution``, ``level``, ...), kept as metadata."""


@dataclass(frozen=True)
class PromptRecord:
    """A prompt as it enters rollout: the rendered text, its token ids, and the answer to verify.

    Example:
        >>> r = PromptRecord(id="arith-3+5", problem="3+5=", prompt_text="3+5=", prompt_ids=(6, 15, 10, 16),
        ...                  answer="8", source="arith")
        >>> len(r.prompt_ids), r.answer
        (4, '8')
    """

    id: str
    """Problem id (unique within ``source``)."""
    problem: str
    """The raw problem statement (for logs and eval rows)."""
    prompt_text: str
    """Exactly the text that was tokenized: instruction and chat template applied (math), or the raw
    ``"a+b="`` (arith)."""
    prompt_ids: tuple[int, ...]
    """Token ids of ``prompt_text`` (no special tokens added beyond those the template writes)."""
    answer: str
    """Ground truth handed to the reward function."""
    source: str
    """Dataset name."""
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """Row metadata, passed to user reward functions as ``extra``."""
    tools: tuple[str, ...] | None = None
    """The tools this prompt may call in tool-integrated rollouts, as its row's ``tools`` list names them
    (``[]``: none, and no tool instruction in the prompt); None: every tool of ``tools.enabled``."""
