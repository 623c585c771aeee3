"""Prompt rendering: the PACS instruction, the shipped Qwen2.5 ChatML template, the length filter."""

import pytest

from pacs_megatron.data import INSTRUCTION, DataFormatError, Problem, load_tokenizer
from pacs_megatron.data.prompts import build_records, render

# The ChatML form quoted in the shared data README (Qwen2.5-Math's qwen25-math-cot), byte for byte.
README_CHATML = (
    "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
    "<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@pytest.fixture(scope="module")
def qwen_tok(data_root):
    return load_tokenizer(data_root / "tokenizers" / "qwen2.5", "qwen2.5")


def test_template_reproduces_readme_chatml(qwen_tok):
    problem = "What is $1+1$?"
    messages = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": problem}]
    text = qwen_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == README_CHATML.replace("{problem}", problem)
    ids = qwen_tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 151644 and ids[-3:] == qwen_tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]


def test_pacs_prompt_is_one_user_turn_with_the_instruction(qwen_tok):
    text = render(Problem("x", "What is 2+3?", "5", "t"), qwen_tok, "qwen2.5")
    assert text == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3? Please reason step by step, and put your final answer within \\boxed{}."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(Problem("x", "What is 2+3?", "5", "t"), qwen_tok, "none") == f"What is 2+3? {INSTRUCTION}"
    # PACS-parquet rows already carry their messages: rendered as they are, no second instruction.
    pacs = Problem("y", "Q? I.", "1", "t", messages=(("user", "Q? I."),))
    assert render(pacs, qwen_tok, "qwen2.5").count("Please reason") == 0


def test_tokenizer_without_template_is_refused(data_root):
    tok = load_tokenizer(data_root / "tokenizers" / "qwen2.5", "none")
    with pytest.raises(ValueError, match="no chat template"):
        render(Problem("x", "p", "1", "t"), tok, "qwen2.5")
    with pytest.raises(FileNotFoundError, match="tokenizer directory"):
        load_tokenizer(data_root / "nope")


def test_overlong_prompts_drop_or_error(qwen_tok, caplog):
    short = Problem("short", "1+1?", "2", "t")
    long = Problem("long", "word " * 200, "1", "t")
    with caplog.at_level("INFO", logger="pacs_megatron"):
        recs = build_records([short, long, short], qwen_tok, "qwen2.5", max_prompt_length=64, name="set")
    assert [r.id for r in recs] == ["short", "short"]
    assert "dropped 1/3 prompts" in caplog.text
    r = recs[0]
    assert r.prompt_ids == tuple(qwen_tok(r.prompt_text, add_special_tokens=False)["input_ids"])
    assert r.problem == "1+1?" and r.answer == "2"
    with pytest.raises(DataFormatError, match="problem 'long' has .* prompt tokens > data.max_prompt_length=64"):
        build_records([short, long], qwen_tok, "qwen2.5", max_prompt_length=64, overlong="error", name="set")
