"""The synthetic "a+b=" task: problems, character tokenizer, tiny model directory, format warm-up."""

import json
import random
from collections import Counter

import pytest
from _runs import REPO

from pacs_megatron.config import ArithTaskConfig, ConfigError, TinyModelConfig
from pacs_megatron.data.synthetic import (
    DIGIT_IDS,
    EOS_ID,
    arith_problems,
    arith_records,
    arith_splits,
    build_arith_tokenizer,
    format_warmup_examples,
    write_tiny_model_dir,
)


def test_cpu_default_problem_set():
    problems = arith_problems(ArithTaskConfig(max_operand=4, modulo=0))
    assert len(problems) == 25
    assert {p.problem for p in problems} == {f"{a}+{b}=" for a in range(5) for b in range(5)}
    for p in problems:
        a, b = map(int, p.problem[:-1].split("+"))
        assert p.answer == str(a + b)
    assert sorted({int(p.answer) for p in problems}) == list(range(9))


def test_modulo_and_subsets():
    problems = arith_problems(ArithTaskConfig(max_operand=9, modulo=10))
    assert len(problems) == 100 and {p.answer for p in problems} == {str(d) for d in range(10)}
    assert next(p for p in problems if p.problem == "7+8=").answer == "5"
    sub = arith_problems(ArithTaskConfig(max_operand=9, modulo=10, num_problems=12), seed=3)
    assert len({p.id for p in sub}) == 12 and sub == arith_problems(ArithTaskConfig(9, 10, 12), seed=3)
    assert sub != arith_problems(ArithTaskConfig(9, 10, 12), seed=4)
    with pytest.raises(ValueError, match="num_problems=200 exceeds the 100"):
        arith_problems(ArithTaskConfig(max_operand=9, modulo=10, num_problems=200))


def test_character_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    tok = build_arith_tokenizer()
    assert len(tok) == 16 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok("12+7=", add_special_tokens=False)["input_ids"]
    assert ids == [tok.convert_tokens_to_ids(c) for c in "12+7="] and len(ids) == 5
    assert tok.decode([*tok.encode("19"), tok.eos_token_id], skip_special_tokens=True) == "19"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert again("3+5=", add_special_tokens=False)["input_ids"] == tok("3+5=", add_special_tokens=False)["input_ids"]
    assert (again.eos_token_id, again.pad_token_id) == (EOS_ID, tok.pad_token_id)
    assert [again.convert_ids_to_tokens(i) for i in DIGIT_IDS] == list("0123456789")


def test_tiny_model_dir_builds_a_qwen2(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tiny = TinyModelConfig(
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    path = write_tiny_model_dir(tmp_path / "m", tiny)
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["model_type"] == "qwen2"
    assert raw["vocab_size"] % 16 == 0 and raw["vocab_size"] >= 16
    assert (raw["rms_norm_eps"], raw["rope_theta"], raw["hidden_act"], raw["torch_dtype"]) == (
        1e-6,
        10000.0,
        "silu",
        "float32",
    )
    assert raw["tie_word_embeddings"] is False and raw["max_position_embeddings"] == 32
    assert not list(path.glob("*.safetensors"))
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert (raw["eos_token_id"], raw["pad_token_id"]) == (tok.eos_token_id, tok.pad_token_id)
    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    assert cfg.rope_parameters["rope_theta"] == 10000.0 and cfg.num_key_value_heads == 2
    model = AutoModelForCausalLM.from_config(cfg)
    assert model.lm_head.weight.shape == (raw["vocab_size"], 32)
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_format_warmup_targets_are_random_digits_not_answers():
    tok = build_arith_tokenizer()
    records = arith_records(arith_problems(ArithTaskConfig(max_operand=4, modulo=0)), tok) * 40  # 1000
    pairs = format_warmup_examples(records, random.Random(0))
    assert len(pairs) == 1000
    digits = Counter()
    correct = 0
    for rec, (prompt, target) in zip(records, pairs):
        assert prompt == list(rec.prompt_ids)
        assert len(target) == 2 and target[-1] == EOS_ID and target[0] in DIGIT_IDS
        digits[target[0]] += 1
        correct += tok.decode(target, skip_special_tokens=True) == rec.answer
    assert set(digits) == set(DIGIT_IDS)  # every digit, including 9 which is never an answer here
    assert all(60 <= c <= 140 for c in digits.values())  # ~100 each
    assert 50 <= correct <= 150  # chance level (~1/10), not the answer
    assert format_warmup_examples(records, random.Random(0)) == pairs


def test_heldout_split_is_seeded_disjoint_and_complete():
    from pacs_megatron.data.synthetic import arith_split

    cfg = ArithTaskConfig(max_operand=9, modulo=0, test_fraction=0.2)
    train, test = arith_split(cfg)
    assert (len(train), len(test)) == (80, 20)
    assert {p.id for p in train}.isdisjoint({p.id for p in test})
    assert sorted(p.id for p in train + test) == sorted(p.id for p in arith_problems(cfg))
    assert arith_split(cfg) == (train, test)
    assert arith_split(ArithTaskConfig(max_operand=9, modulo=0, test_fraction=0.2, split_seed=1))[1] != test
    assert max(len(p.answer) for p in train + test) == 2  # multi-token answers (0..18)
    everything = arith_split(ArithTaskConfig(max_operand=4, modulo=0))
    assert everything[0] == everything[1] == arith_problems(ArithTaskConfig(max_operand=4, modulo=0))


def test_splits_hold_out_unordered_pairs_and_a_disjoint_validation_split():
    """a+b and b+a always share a split: no held-out (or validation) problem has its commuted twin in
    training; the validation split is disjoint from both others, and the three cover every problem."""
    from pacs_megatron.data.synthetic import arith_split, arith_splits

    def pair(p):
        a, b = p.problem.rstrip("=").split("+")
        return frozenset((a, b))

    cfg = ArithTaskConfig(max_operand=9, modulo=0, test_fraction=0.2, val_fraction=0.2)
    s = arith_splits(cfg)
    assert [len(s[k]) for k in ("train", "val", "test")] == [60, 20, 20]
    pairs = {k: {pair(p) for p in v} for k, v in s.items()}
    assert pairs["train"].isdisjoint(pairs["test"]) and pairs["train"].isdisjoint(pairs["val"])
    assert pairs["val"].isdisjoint(pairs["test"])
    assert sorted(p.id for v in s.values() for p in v) == sorted(p.id for p in arith_problems(cfg))
    # Without a validation split the held-out split is the same one, by pair too (the old split was not).
    train, test = arith_split(ArithTaskConfig(max_operand=9, modulo=0, test_fraction=0.2))
    assert test == s["test"] and {pair(p) for p in train}.isdisjoint({pair(p) for p in test})
    with pytest.raises(ConfigError, match="val_fraction"):
        ArithTaskConfig(max_operand=9, modulo=0, val_fraction=0.2)


def test_format_warmup_does_not_reveal_the_answer_length():
    tok = build_arith_tokenizer()
    records = arith_records(arith_problems(ArithTaskConfig(max_operand=9, modulo=0)), tok) * 10  # 1000
    pairs = format_warmup_examples(records, random.Random(0), max_digits=2)
    by_len = Counter()
    for rec, (_, target) in zip(records, pairs):
        assert target[-1] == EOS_ID and all(t in DIGIT_IDS for t in target[:-1])
        by_len[(len(rec.answer), len(target) - 1)] += 1
    # One- and two-digit answers both get one- and two-digit targets, about half each.
    for answer_len in (1, 2):
        n = by_len[(answer_len, 1)] + by_len[(answer_len, 2)]
        assert 0.4 * n <= by_len[(answer_len, 1)] <= 0.6 * n, by_len


def test_zero_padded_answers_have_one_length_and_the_warmup_keeps_it():
    cfg = ArithTaskConfig(max_operand=9, modulo=0, answer_width=2)
    problems = arith_problems(cfg)
    assert {len(p.answer) for p in problems} == {2}
    assert {p.problem: p.answer for p in problems}["3+4="] == "07"
    assert {p.problem: p.answer for p in problems}["9+9="] == "18"
    records = arith_records(problems, build_arith_tokenizer())
    pairs = format_warmup_examples(records, random.Random(0), max_digits=2, min_digits=2)
    assert {len(t) for _, t in pairs} == {3}  # always two random digits + eos
    assert len({tuple(t[:2]) for _, t in pairs}) > 30  # ... drawn at random, not the answer
    with pytest.raises(ConfigError, match=r"data.arith.answer_width=1 .* largest answer 18"):
        ArithTaskConfig(max_operand=9, modulo=0, answer_width=1)
    with pytest.raises(ConfigError, match="data.arith.answer_width"):
        ArithTaskConfig(answer_width=-1)


def test_problem_subset_and_splits_do_not_depend_on_the_training_seed():
    """With num_problems, the subset is drawn by split_seed like the splits: runs with other data.seed
    (the seeds of a comparison) train and validate on the same problems."""
    from pacs_megatron.config import load_config
    from pacs_megatron.loop.build import train_dataset, val_datasets

    tok = build_arith_tokenizer()
    base = ["data.arith.num_problems=40", "data.arith.test_fraction=0.25", "data.arith.max_operand=19"]
    sets = []
    for seed in (1, 2):
        cfg = load_config(None, ["model.init=tiny", "model.path=x", "reward.fn=arith", "data.task=arith", *base])
        cfg.data.seed = seed
        train = train_dataset(cfg, tok)
        sets.append(({r.id for r in train.records}, {k: [r.id for r in v] for k, v in val_datasets(cfg, tok).items()}))
    assert sets[0] == sets[1]
    assert len(sets[0][0]) == 30 and len(sets[0][1]["arith_heldout"]) == 10


def test_words_style_pairs_and_range():
    cfg = ArithTaskConfig(style="words", min_operand=10, max_operand=12, modulo=0, test_fraction=0.34)
    s = arith_splits(cfg)
    assert s["test"][0].problem.startswith("What is 1") and s["test"][0].problem.endswith("?")
    ops = {tuple(sorted(map(int, p.id.removeprefix("arith-").split("+")))) for p in s["train"]}
    held = {tuple(sorted(map(int, p.id.removeprefix("arith-").split("+")))) for p in s["test"]}
    assert ops.isdisjoint(held) and all(10 <= x <= 12 for pair in ops | held for x in pair)
    assert {p.answer for p in s["train"] + s["test"]} <= {str(x) for x in range(20, 25)}
    with pytest.raises(ConfigError, match="min_operand=5 exceeds"):
        ArithTaskConfig(min_operand=5, max_operand=4)


def test_smollm2_recipe_splits_are_disjoint():
    """The real-model recipe's train / validation / held-out problems: no problem twice, no commuted
    twin across splits, the validation split apart from the held-out one, and the same split for
    every training seed."""
    from pacs_megatron.config import load_config

    cfg = load_config(str(REPO / "examples" / "configs" / "cpu_smollm2.yaml"), ["data.seed=7"])
    assert cfg.data.arith.style == "words" and cfg.reward.fn == "math_boxed"
    s = arith_splits(cfg.data.arith)
    assert [len(s[k]) for k in ("train", "val", "test")] == [120, 40, 40]
    texts = [p.problem for v in s.values() for p in v]
    assert len(texts) == len(set(texts)) == cfg.data.arith.num_problems
    pairs = {k: {frozenset(p.id.removeprefix("arith-").split("+")) for p in v} for k, v in s.items()}
    assert not (pairs["train"] & pairs["val"] or pairs["train"] & pairs["test"] or pairs["val"] & pairs["test"])
    assert all(int(p.answer) == sum(map(int, p.id.removeprefix("arith-").split("+"))) for p in s["test"])
    assert arith_splits(load_config(str(REPO / "examples" / "configs" / "cpu_smollm2.yaml")).data.arith) == s
