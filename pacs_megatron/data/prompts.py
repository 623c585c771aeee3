"""Problems -> prompts: the PACS instruction, the chat template, tokenization and the length filter.

Math prompts follow PACS (ritzz-ai/PACS ``preprocess_dataset.py``): one user message
``f"{problem} Please reason step by step, and put your final answer within \\boxed{{}}."`` rendered
with a chat template chosen by ``data.chat_template`` (:func:`select_template`):

- ``"auto"`` (default): the tokenizer's own template, as verl and TRL use it; a Qwen2 tokenizer
  without one (the shared Qwen2.5 tokenizer files have none) gets the shipped Qwen2.5 ChatML
  (``templates/qwen2.5.jinja``), and any other tokenizer without one is refused: a non-Qwen model
  never silently gets ChatML;
- ``"model"``: the tokenizer's own template, refused when it has none;
- ``"qwen2.5"``: the shipped Qwen2.5 ChatML, whatever the tokenizer;
- ``"none"``: the instruction-suffixed text raw (base-model style).
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from pacs_megatron.config.base import ConfigError
from pacs_megatron.data.records import DataFormatError, Problem, PromptRecord
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""PACS's instruction, appended to every math problem after a space."""

TEMPLATES = {"qwen2.5": "qwen2.5.jinja"}
"""Chat template names -> files under ``pacs_megatron/data/templates``."""
CHOICES = ("auto", "model", "none", *TEMPLATES)
"""Values of ``data.chat_template`` (and eval's ``--chat-template``)."""


def with_instruction(problem: str) -> str:
    """The PACS user message.

    Example:
        >>> with_instruction("What is 1+1?")
        'What is 1+1? Please reason step by step, and put your final answer within \\\\boxed{}.'
    """
    return f"{problem} {INSTRUCTION}"


def chat_template(name: str) -> str | None:
    """The Jinja source of a shipped template, or None for ``"none"``."""
    if name == "none":
        return None
    if name not in TEMPLATES:
        raise ValueError(f"chat template {name!r} is unknown: choose one of {sorted(TEMPLATES)} or 'none'")
    return resources.files("pacs_megatron.data").joinpath("templates", TEMPLATES[name]).read_text(encoding="utf-8")


def select_template(choice: str, own: str | None, qwen_tokenizer: bool, where: str = "the tokenizer") -> str | None:
    """The Jinja source ``data.chat_template=choice`` gives a tokenizer whose own template is ``own``
    (None: it has none), or None for raw text; :class:`ConfigError` (one line) when nothing fits.

    Example:
        >>> select_template("auto", "{{ x }}", qwen_tokenizer=False)
        '{{ x }}'
        >>> select_template("auto", None, qwen_tokenizer=True).startswith("{#- Qwen2.5 ChatML")
        True
    """
    if choice not in CHOICES:
        raise ConfigError(f"data.chat_template={choice!r} is not valid: choose one of {list(CHOICES)}")
    if choice in ("none", *TEMPLATES):
        return chat_template(choice)
    if own:
        return own
    if choice == "model":
        raise ConfigError(
            f"data.chat_template=model: {where} has no chat template: set data.chat_template=none (raw prompt text)"
            " or qwen2.5 (ChatML), or use a tokenizer that ships one"
        )
    if not qwen_tokenizer:
        raise ConfigError(
            f"data.chat_template=auto: {where} has no chat template and is not a Qwen2 tokenizer, so none is "
            "guessed: set data.chat_template=none (raw prompt text) or qwen2.5 (ChatML), or use a tokenizer that "
            "ships one"
        )
    logger.info("data.chat_template=auto: %s has no chat template; using the shipped Qwen2.5 ChatML", where)
    return chat_template("qwen2.5")


def is_qwen_tokenizer(class_name: str | None) -> bool:
    """Whether a tokenizer class (``tokenizer_config.json``'s ``tokenizer_class``) is Qwen2's."""
    return class_name is not None and class_name.startswith("Qwen2")


def load_tokenizer(path: str | Path, template: str = "auto"):
    """A fast tokenizer from a local directory (never the network), with its chat template chosen by
    ``template`` (:func:`select_template`; ``"none"`` leaves the tokenizer's own in place, unused).

    A tokenizer without a pad token gets its EOS as pad. Padding side is left as configured: every
    consumer here pads token ids itself.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist (model.tokenizer / --tokenizer)")
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if template != "none":
        qwen = is_qwen_tokenizer(type(tok).__name__)
        tok.chat_template = select_template(template, tok.chat_template or None, qwen, f"the tokenizer in {path}")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def row_tools(problem: Problem | PromptRecord) -> tuple[str, ...] | None:
    """The tools a row may call: its ``tools`` field (a list of tool names, ``[]`` for none), or None when the
    row has none (every enabled tool). A malformed field raises naming the row.

    Example:
        >>> row_tools(Problem("p1", "1+1", "2", "mine", extra={"tools": ["python"]}))
        ('python',)
    """
    tools = problem.extra.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, str) and t for t in tools):
        raise DataFormatError(
            f"dataset {problem.source}: problem {problem.id!r} has tools={tools!r}: give a list of tool names "
            '(e.g. ["python"]; [] for none), or leave the field out for every tool of tools.enabled'
        )
    return tuple(tools)


def render(problem: Problem, tokenizer, template: str, shots: Sequence[Sequence[str]] = (), suffix: str = "") -> str:
    """The prompt text of a math problem under ``template`` (any of :data:`CHOICES`; the tokenizer's
    ``chat_template`` is the one :func:`load_tokenizer` selected).

    Rows that already hold chat messages (PACS parquet) are rendered as they are; plain rows get the
    PACS instruction in one user turn. ``shots`` (``data.shots``: [problem, response] pairs) come as
    earlier user/assistant turns after the row's system turn(s), if any: a system message opens a
    conversation, so a shot placed before it would be outside it. With ``template="none"`` the text is the
    shots (question, then response) above the last turn; the row's system text is left out, as it is
    without shots. ``suffix`` (the tool instruction of multi-turn rollouts) ends the row's last user turn.
    """
    messages = [{"role": r, "content": c} for r, c in problem.messages or ()] or [
        {"role": "user", "content": with_instruction(problem.problem)}
    ]
    if suffix:
        messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']} {suffix}"}
    examples = [
        {"role": role, "content": text}
        for question, response in shots
        for role, text in (("user", with_instruction(question)), ("assistant", response))
    ]
    if template == "none":
        return "\n\n".join(m["content"] for m in [*examples, messages[-1]])
    n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    messages = messages[:n_system] + examples + messages[n_system:]
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template: load it with load_tokenizer(path, template)")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def tokenize_prompts(
    problems: Sequence[Problem],
    texts: Sequence[str],
    tokenizer,
    max_prompt_length: int,
    overlong: str = "drop",
    name: str = "",
) -> list[PromptRecord]:
    """Records of ``problems`` whose rendered ``texts`` fit in ``max_prompt_length`` tokens.

    ``overlong="drop"`` drops longer ones and logs how many; ``"error"`` raises naming the first.
    """
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
    records, dropped = [], []
    for p, text, tok_ids in zip(problems, texts, ids):
        if len(tok_ids) > max_prompt_length:
            if overlong == "error":
                raise DataFormatError(
                    f"dataset {name or p.source}: problem {p.id!r} has {len(tok_ids)} prompt tokens > "
                    f"data.max_prompt_length={max_prompt_length} (raise it, or set data.overlong_prompts=drop)"
                )
            dropped.append(p.id)
            continue
        records.append(
            PromptRecord(
                id=p.id,
                problem=p.problem,
                prompt_text=text,
                prompt_ids=tuple(tok_ids),
                answer=p.answer,
                source=p.source,
                extra=p.extra,
            )
        )
    if dropped:
        logger.info(
            "dataset %s: dropped %d/%d prompts longer than data.max_prompt_length=%d tokens (first: %s)",
            name,
            len(dropped),
            len(problems),
            max_prompt_length,
            dropped[0],
        )
    if not records:
        raise DataFormatError(
            f"dataset {name}: every prompt is longer than data.max_prompt_length={max_prompt_length} tokens"
        )
    return records


def build_records(
    problems: Sequence[Problem],
    tokenizer,
    template: str,
    max_prompt_length: int,
    overlong: str = "drop",
    name="",
    shots: Sequence[Sequence[str]] = (),
    suffix: str = "",
) -> list[PromptRecord]:
    """Render and tokenize math problems (shots + instruction + template), applying the length filter. A row
    whose ``tools`` list is empty gets no ``suffix`` (the tool instruction): it may call none."""
    # the row's tools are read only when there is a tool instruction to give: single-turn runs never parse them
    texts = [render(p, tokenizer, template, shots, suffix if suffix and row_tools(p) != () else "") for p in problems]
    return tokenize_prompts(problems, texts, tokenizer, max_prompt_length, overlong, name)
