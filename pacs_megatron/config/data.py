"""Dataset and reward settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pacs_megatron.config.base import ConfigError, _choice, _positive


@dataclass
class ArithTaskConfig:
    """The synthetic verifiable task: "a+b=" answered by the digits of the sum (the CPU default), or the
    same sums asked in words for a pretrained model (``style=words``)."""

    max_operand: int = 9
    """Operands are drawn from min_operand..max_operand."""
    modulo: int = 10
    """Answers are (a + b) % modulo, a one-token answer; 0 disables the modulo."""
    num_problems: int = 0
    """Distinct problems (a seeded subset, before the split); 0 means all ordered pairs of operands."""
    test_fraction: float = 0.0
    """Share of the problems held out for validation (a seeded split by ``split_seed``): RL trains on
    the rest and validation runs on these only, so pass@1 measures generalisation; 0 trains and
    validates on every problem (memorisation)."""
    val_fraction: float = 0.0
    """Share of the problems kept out of training for a validation set ("arith_val", e.g. to tune the
    lr on), disjoint from the held-out split; like it, drawn by unordered pair. Needs test_fraction > 0."""
    split_seed: int = 0
    """Seed of the held-out split and of the num_problems subset (kept apart from data.seed so every
    training seed sees the same problems and split)."""
    answer_width: int = 0
    """Zero-pad every answer to this many digits ("07" for 7 at width 2), so all answers have one
    length and a shorter guess is wrong (the reward is an exact match): the policy cannot shrink to
    the easier one-digit answers and must learn the carry. 0: no padding."""
    style: str = "raw"
    """"raw": the prompt is "3+5=" and the answer exactly "8" (reward.fn=arith; no template); "words": the
    math-problem form "What is 3 + 5?" with the PACS instruction (answer in \\boxed{}) under
    data.chat_template, scored by math-verify (reward.fn=math), for pretrained models."""
    min_operand: int = 0
    """Smallest operand."""

    def __post_init__(self) -> None:
        _choice("data.arith.style", self.style, ("raw", "words"))
        _positive("data.arith.max_operand", self.max_operand)
        _positive("data.arith.min_operand", self.min_operand, allow_zero=True)
        if self.min_operand > self.max_operand:
            raise ConfigError(
                f"data.arith.min_operand={self.min_operand} exceeds data.arith.max_operand={self.max_operand}"
            )
        _positive("data.arith.modulo", self.modulo, allow_zero=True)
        _positive("data.arith.answer_width", self.answer_width, allow_zero=True)
        largest = self.modulo - 1 if self.modulo else 2 * self.max_operand
        if self.answer_width and len(str(largest)) > self.answer_width:
            raise ConfigError(
                f"data.arith.answer_width={self.answer_width} is shorter than the largest answer {largest}: "
                f"set it to {len(str(largest))} or more, or 0 for no padding"
            )
        if not 0.0 <= self.test_fraction < 1.0:
            raise ConfigError(f"data.arith.test_fraction={self.test_fraction} must be in [0, 1), e.g. 0.2")
        if not 0.0 <= self.val_fraction < 1.0 - self.test_fraction or (self.val_fraction and not self.test_fraction):
            raise ConfigError(
                f"data.arith.val_fraction={self.val_fraction} must be in [0, 1 - test_fraction) and needs "
                "data.arith.test_fraction > 0 (the validation split is cut from what the held-out split leaves)"
            )


@dataclass
class DataConfig:
    """Prompt datasets."""

    task: str = "math"
    """"math" (JSONL/parquet math problems) or "arith" (the built-in synthetic task, ``data.arith``)."""
    data_root: str = ""
    """Folder that dataset names resolve against; empty: $PACS_DATA_ROOT, else ../shared/data."""
    train_files: list[str] = field(default_factory=lambda: ["deepscaler_subset803"])
    """Train sets: names of the shared sets (math_train, deepscaler_subset803, ...) or file paths."""
    val_files: list[str] = field(default_factory=lambda: ["math500"])
    """Validation sets (names or paths) for periodic pass@k."""
    chat_template: str = "auto"
    """"auto": the tokenizer's own template (as verl and TRL), else the shipped Qwen2.5 ChatML for a Qwen2
    tokenizer, else an error; "model": the tokenizer's own, an error without one; "qwen2.5": the shipped
    ChatML; "none": raw prompt text. Only data.task=math renders prompts (data/prompts.py)."""
    shots: list[list[str]] = field(default_factory=list)
    """Worked examples shown before every problem, as earlier turns of the chat: ``[[problem, response],
    ...]``; each problem gets the PACS instruction like the real one, each response must end its answer
    in ``\\boxed{}``. Empty (the default, PACS's setting): the problem alone. A small instruct model that
    rarely boxes its answer (SmolLM2-135M: 3% of one-digit sums) learns the answer format from one shot;
    pick examples outside the task's problems so no held-out answer is shown."""
    max_prompt_length: int = 512
    """Prompts longer than this (in tokens) are handled per ``overlong_prompts``."""
    overlong_prompts: str = "drop"
    """"drop" (counted in the log) or "error"."""
    bad_records: str = "error"
    """Malformed rows: "error" (file, line and field named) or "skip" (counted)."""
    shuffle: bool = True
    """Shuffle each epoch, deterministically from ``seed``."""
    seed: int = 42
    """Shuffling seed."""
    arith: ArithTaskConfig = field(default_factory=ArithTaskConfig)
    """Settings of the synthetic task (task=arith)."""

    def __post_init__(self) -> None:
        _choice("data.task", self.task, ("math", "arith"))
        _choice("data.chat_template", self.chat_template, ("auto", "model", "qwen2.5", "none"))
        _choice("data.overlong_prompts", self.overlong_prompts, ("drop", "error"))
        _choice("data.bad_records", self.bad_records, ("error", "skip"))
        _positive("data.max_prompt_length", self.max_prompt_length)
        for i, shot in enumerate(self.shots):
            if len(shot) != 2 or not all(isinstance(x, str) and x.strip() for x in shot):
                raise ConfigError(f"data.shots[{i}]={shot!r}: give [problem, response], two non-empty strings")
            if "\\boxed{" not in shot[1]:
                raise ConfigError(f"data.shots[{i}]: the response shows no \\boxed{{}} answer; end it with one")
        if self.shots and not self.renders_prompts:
            raise ConfigError("data.shots needs prompts rendered as math problems (data.task=math, or arith in words)")
        if self.task == "math" and not self.train_files:
            raise ConfigError("data.train_files is empty: name at least one set, e.g. data.train_files=[math_train]")

    @property
    def renders_prompts(self) -> bool:
        """Whether prompts are math problems under ``chat_template`` (task=math, or arith in words)."""
        return self.task == "math" or self.arith.style == "words"

    def resolved_root(self) -> Path:
        """``data_root``, else $PACS_DATA_ROOT, else the first existing of ``<repo>/../shared/data``,
        ``<repo>/shared/data`` and ``./shared/data`` (the repo's neighbour by default)."""
        if self.data_root:
            return Path(self.data_root)
        env = os.environ.get("PACS_DATA_ROOT")
        if env:
            return Path(env)
        repo = Path(__file__).resolve().parents[2]
        candidates = [repo.parent / "shared" / "data", repo / "shared" / "data", Path.cwd() / "shared" / "data"]
        return next((c for c in candidates if c.is_dir()), candidates[0])


@dataclass
class RewardConfig:
    """The verifiable reward."""

    fn: str = "math"
    """"math" (math-verify, PACS's reward), "math_boxed" (math-verify on the last \\boxed{} only, a number
    boxed as a number: no box, no reward), "arith" (exact match of the synthetic task) or
    "module.path:function" with signature (prompt, response, ground_truth, extra) -> float."""
    num_workers: int = 2
    """Scoring processes (math-verify's timeouts only work outside threads); 0 means one: rewards
    never run unprotected in the trainer's process."""
    timeout_s: float = 10.0
    """Per-response scoring timeout, in every mode; a timeout scores 0, is counted, and its worker
    is replaced."""
    max_failure_steps: int = 3
    """Stop the run with an error naming reward.fn and its last exception after this many
    consecutive steps in which every response failed to score (0: never stop)."""
    backend: str = "local"
    """Where the ``num_workers`` scorers run: "local" (processes beside each rank) or "ray" (actors
    spread over the Ray cluster of $RAY_ADDRESS, or a private one; see reward/ray_backend.py)."""

    def __post_init__(self) -> None:
        if self.fn not in ("math", "math_boxed", "arith") and ":" not in self.fn:
            raise ConfigError(f"reward.fn={self.fn!r}: use 'math', 'math_boxed', 'arith' or 'package.module:function'")
        _positive("reward.num_workers", self.num_workers, allow_zero=True)
        _positive("reward.timeout_s", self.timeout_s)
        _positive("reward.max_failure_steps", self.max_failure_steps, allow_zero=True)
        _choice("reward.backend", self.backend, ("local", "ray"))
        if self.backend == "ray" and self.num_workers == 0:
            raise ConfigError("reward.backend=ray needs reward.num_workers >= 1 (the number of Ray scoring actors)")
