"""Prompt rendering: the PACS instruction, the chat template choice (auto / model / qwen2.5 / none), the
length filter."""

from pathlib import Path

import pytest

from pacs_megatron.data import INSTRUCTION, DataFormatError, Problem, load_tokenizer
from pacs_megatron.data.prompts import build_records, render

# The ChatML form quoted in the shared data README (Qwen2.5-Math's qwen25-math-cot), byte for byte.
README_CHATML = (
    "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
    "<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"
)
REPO = Path(__file__).resolve().parents[2]
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


OWN = (
    "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}"
    "{% if add_generation_prompt %}<<a|{% endif %}"
)


@pytest.fixture(scope="module")
def plain_toks(tmp_path_factory):
    """Two non-Qwen tokenizer dirs (the arith character tokenizer): without and with a template of its own."""
    from pacs_megatron.data.synthetic import build_arith_tokenizer

    root = tmp_path_factory.mktemp("toks")
    bare, own = root / "bare", root / "own"
    build_arith_tokenizer().save_pretrained(str(bare))
    tok = build_arith_tokenizer()
    tok.chat_template = OWN
    tok.save_pretrained(str(own))
    return bare, own


def test_template_choice(plain_toks, data_root):
    from pacs_megatron.config import ConfigError

    bare, own = plain_toks
    p = Problem("x", "1+1", "2", "t")
    # auto and model take the tokenizer's own template (as verl and TRL do); qwen2.5 and none are explicit
    for choice in ("auto", "model"):
        assert render(p, load_tokenizer(own, choice), choice) == f"<<user|1+1 {INSTRUCTION}>><<a|"
    assert render(p, load_tokenizer(own, "qwen2.5"), "qwen2.5").startswith("<|im_start|>system\nYou are Qwen")
    assert render(p, load_tokenizer(own, "none"), "none") == f"1+1 {INSTRUCTION}"
    # a non-Qwen tokenizer without a template never gets ChatML by default: one line naming the fix
    for choice, match in (("auto", "has no chat template and is not a Qwen2"), ("model", "has no chat template")):
        with pytest.raises(ConfigError, match=f"data.chat_template={choice}: the tokenizer in .*bare {match}") as e:
            load_tokenizer(bare, choice)
        assert "\n" not in str(e.value) and "data.chat_template=none" in str(e.value)
    # the shared Qwen2.5 tokenizer files carry no template: auto gives the shipped ChatML, model refuses
    qwen = data_root / "tokenizers" / "qwen2.5"
    assert render(p, load_tokenizer(qwen, "auto"), "auto") == render(p, load_tokenizer(qwen, "qwen2.5"), "qwen2.5")
    with pytest.raises(ConfigError, match="data.chat_template=model"):
        load_tokenizer(qwen, "model")


def test_template_choice_checked_before_any_rank(plain_toks, tmp_path, capfd):
    """The launcher reads the same choice from the tokenizer files (no load), and eval refuses in one line."""
    from pacs_megatron.cli import main
    from pacs_megatron.config import ConfigError, load_config
    from pacs_megatron.launch.checks.preflight import check_chat_template

    bare, own = plain_toks
    cfg = [f"model.path={tmp_path}", f"model.tokenizer={bare}", "data.task=math", "reward.fn=math"]
    config = REPO / "examples" / "configs" / "cpu_tiny.yaml"
    for choice in ("auto", "model"):
        with pytest.raises(ConfigError, match=f"data.chat_template={choice}: the tokenizer in"):
            check_chat_template(load_config(config, [*cfg, f"data.chat_template={choice}"]), to_write=False)
    check_chat_template(load_config(config, [*cfg, "data.chat_template=none"]), to_write=False)
    check_chat_template(load_config(config, [*cfg, f"model.tokenizer={own}", "data.chat_template=model"]), False)

    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "m"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(model)  # fmt: skip
    (tmp_path / "p.jsonl").write_text('{"id": "a", "problem": "1+1", "answer": "2", "source": "t"}\n')
    argv = [
        "eval",
        "--model",
        str(model),
        "--tokenizer",
        str(bare),
        "--data",
        str(tmp_path / "p.jsonl"),
        "--n",
        "1",
        "--k",
        "1",
    ]
    capfd.readouterr()
    assert main(argv) == 2  # the default --chat-template auto, refused before any engine is built
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "chat_template" in lines[0] and "auto" in lines[0], lines


def test_shots_are_earlier_turns_after_the_system_turn(qwen_tok):
    from pacs_megatron.config import ConfigError, DataConfig

    shot = ["What is 23 + 45?", "23 + 45 = 68. The answer is \\boxed{68}."]
    p = Problem("x", "What is 2+3?", "5", "t")
    text = render(p, qwen_tok, "qwen2.5", [shot])
    assert text == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\nWhat is 23 + 45? {INSTRUCTION}<|im_end|>\n"
        f"<|im_start|>assistant\n{shot[1]}<|im_end|>\n"
        f"<|im_start|>user\nWhat is 2+3? {INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        render(p, qwen_tok, "none", [shot])
        == f"What is 23 + 45? {INSTRUCTION}\n\n{shot[1]}\n\nWhat is 2+3? {INSTRUCTION}"
    )
    assert render(p, qwen_tok, "qwen2.5", []) == render(p, qwen_tok, "qwen2.5")  # the default: no shots
    records = build_records([p], qwen_tok, "qwen2.5", 512, shots=[shot])
    assert records[0].prompt_text == text
    # A row with its own system turn (PACS parquet): the shots follow the system turn, and with
    # template=none the shot's question survives (issue #40 R5).
    row = Problem("y", "Q", "5", "t", messages=(("system", "SYS"), ("user", "USER Q")))
    assert render(row, qwen_tok, "qwen2.5", [shot]) == (
        "<|im_start|>system\nSYS<|im_end|>\n"
        f"<|im_start|>user\nWhat is 23 + 45? {INSTRUCTION}<|im_end|>\n"
        f"<|im_start|>assistant\n{shot[1]}<|im_end|>\n"
        "<|im_start|>user\nUSER Q<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(row, qwen_tok, "none", [shot]) == f"What is 23 + 45? {INSTRUCTION}\n\n{shot[1]}\n\nUSER Q"
    assert render(row, qwen_tok, "none") == "USER Q"  # without shots, as before
    with pytest.raises(ConfigError, match=r"data.shots\[0\].*\[problem, response\]"):
        DataConfig(task="math", shots=[["only a problem"]])
    with pytest.raises(ConfigError, match=r"data.shots\[0\]: the response shows no \\boxed"):
        DataConfig(task="math", shots=[["What is 1 + 1?", "2"]])
    with pytest.raises(ConfigError, match="data.shots needs prompts rendered as math problems"):
        DataConfig(task="arith", shots=[shot])
