"""The synthetic verifiable task of the CPU default: "a+b=" answered by the decimal digits of the sum.

Problems are all pairs ``a, b in 0..max_operand`` (or a seeded subset of ``num_problems``), answer
``(a + b) % modulo`` (``modulo=0``: no modulo). The CPU default (max_operand=4, modulo=0) has 25
problems with answers 0..8. A prompt is the raw text ``"3+5="`` (no instruction, no template) and the
correct response is ``"8"`` followed by EOS, scored by exact match (``reward.fn=arith``).
``test_fraction > 0`` holds out a seeded share of the problems (:func:`arith_splits`): larger operands
(e.g. ``max_operand=9``: sums 0..18) give multi-token answers and a generalisation test. The split is
by *unordered pair*: "3+5=" and "5+3=" always land in the same split, so no held-out problem has its
commuted twin in training. ``val_fraction`` takes a validation split (for tuning, e.g. the lr) the
same way from what is left: train, validation and held-out test are pairwise disjoint.

The tokenizer is character level, built offline with ``tokenizers`` (WordLevel over single
characters) and wrapped as a transformers ``PreTrainedTokenizerFast``; its 16 tokens fill the
embedding exactly, so the model can never sample an id the tokenizer cannot decode::

    0 <|endoftext|> (pad)   1 <|im_end|> (eos)   2 <unk>   3..12 "0".."9"   13 "+"   14 "="   15 " "

``write_tiny_model_dir`` writes that tokenizer plus a Qwen2 ``config.json`` (no weights: the actor
initialises them and the rollout engine receives them by weight sync).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from pacs_megatron.config import ArithTaskConfig, TinyModelConfig
from pacs_megatron.data.records import Problem, PromptRecord

PAD, EOS, UNK = "<|endoftext|>", "<|im_end|>", "<unk>"
VOCAB: tuple[str, ...] = (PAD, EOS, UNK, *"0123456789", "+", "=", " ")
"""Token strings in id order."""
DIGIT_IDS: tuple[int, ...] = tuple(VOCAB.index(str(d)) for d in range(10))
EOS_ID, PAD_ID = VOCAB.index(EOS), VOCAB.index(PAD)


def arith_problems(cfg: ArithTaskConfig, seed: int = 0) -> list[Problem]:
    """The task's problems, in (a, b) order; a seeded subset when ``cfg.num_problems`` > 0.

    Example:
        >>> ps = arith_problems(ArithTaskConfig(max_operand=4, modulo=0))
        >>> len(ps), ps[-1].problem, ps[-1].answer, sorted({p.answer for p in ps})[-1]
        (25, '4+4=', '8', '8')
    """
    span = range(cfg.min_operand, cfg.max_operand + 1)
    if cfg.num_problems and cfg.num_problems > len(span) ** 2:
        raise ValueError(
            f"data.arith.num_problems={cfg.num_problems} exceeds the {len(span) ** 2} distinct problems of "
            f"operands {cfg.min_operand}..{cfg.max_operand}"
        )
    if cfg.num_problems and len(span) ** 2 > ENUMERATE_PAIRS:  # 3-4 digit operands: 10^8 pairs, never listed
        pairs = sorted(_sample_pairs(span, cfg.num_problems, random.Random(seed)))
    else:
        pairs = [(a, b) for a in span for b in span]
        if cfg.num_problems:
            pairs = sorted(random.Random(seed).sample(pairs, cfg.num_problems))
    out = []
    for a, b in pairs:
        answer = (a + b) % cfg.modulo if cfg.modulo else a + b
        text = f"{answer:0{cfg.answer_width}d}" if cfg.answer_width else str(answer)
        problem = f"What is {a} + {b}?" if cfg.style == "words" else f"{a}+{b}="
        out.append(Problem(id=f"arith-{a}+{b}", problem=problem, answer=text, source="arith"))
    return out


ENUMERATE_PAIRS = 1_000_000
"""Above this many operand pairs the task draws its problems without listing every pair (the draw differs from
the listed one, which smaller tasks keep so that their problem sets stay what they were)."""


def _sample_pairs(span: range, k: int, rng: random.Random) -> set[tuple[int, int]]:
    """``k`` distinct (a, b) pairs of ``span``, uniformly (rejection of repeats: k is far below the pair count)."""
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < k:
        pairs.add((rng.choice(span), rng.choice(span)))
    return pairs


def _operands(p: Problem) -> tuple[int, int]:
    a, b = p.id.removeprefix("arith-").split("+")
    return min(int(a), int(b)), max(int(a), int(b))


def _take_pairs(problems: Sequence[Problem], candidates: Sequence[int], k: int, rng: random.Random) -> set[int]:
    """Indices of ``k`` problems among ``candidates``, whole unordered pairs only (a pair that would
    overshoot ``k`` is skipped; the one-problem pairs a+a fill the rest)."""
    pairs: dict[tuple[int, int], list[int]] = {}
    for i in candidates:
        pairs.setdefault(_operands(problems[i]), []).append(i)
    order = sorted(pairs)
    rng.shuffle(order)
    taken: list[int] = []
    for key in order:
        if len(taken) + len(pairs[key]) <= k:
            taken += pairs[key]
        if len(taken) == k:
            break
    return set(taken)


def arith_splits(cfg: ArithTaskConfig) -> dict[str, list[Problem]]:
    """``{"train", "val", "test"}`` problems (each in (a, b) order): a ``split_seed``-seeded
    ``test_fraction`` held out, then a ``val_fraction`` for validation, both by unordered pair; with
    ``test_fraction=0`` train and test are all problems and val is empty. The ``num_problems`` subset is
    drawn with ``split_seed`` too: every training seed (``data.seed``) sees the same problems.

    Example:
        >>> s = arith_splits(ArithTaskConfig(max_operand=9, modulo=0, test_fraction=0.2, val_fraction=0.2))
        >>> [len(s[k]) for k in ("train", "val", "test")]
        [60, 20, 20]
    """
    problems = arith_problems(cfg, cfg.split_seed)
    if not cfg.test_fraction:
        return {"train": problems, "val": [], "test": problems}
    n = len(problems)
    k_test, k_val = round(n * cfg.test_fraction), round(n * cfg.val_fraction)
    if not (0 < k_test and k_test + k_val < n and (k_val > 0 or not cfg.val_fraction)):
        raise ValueError(
            f"data.arith.test_fraction={cfg.test_fraction} and val_fraction={cfg.val_fraction} of {n} problems "
            "leave an empty split"
        )
    rng = random.Random(cfg.split_seed)
    test = _take_pairs(problems, range(n), k_test, rng)
    val = _take_pairs(problems, [i for i in range(n) if i not in test], k_val, rng) if k_val else set()
    return {
        "train": [p for i, p in enumerate(problems) if i not in test and i not in val],
        "val": [p for i, p in enumerate(problems) if i in val],
        "test": [p for i, p in enumerate(problems) if i in test],
    }


def arith_split(cfg: ArithTaskConfig) -> tuple[list[Problem], list[Problem]]:
    """``(train, test)`` of :func:`arith_splits` (the validation split is in neither)."""
    s = arith_splits(cfg)
    return s["train"], s["test"]


def arith_records(problems: Sequence[Problem], tokenizer) -> list[PromptRecord]:
    """Prompt records of the task: the raw problem text is the prompt."""
    ids = tokenizer([p.problem for p in problems], add_special_tokens=False)["input_ids"]
    return [
        PromptRecord(
            id=p.id, problem=p.problem, prompt_text=p.problem, prompt_ids=tuple(i), answer=p.answer, source=p.source
        )
        for p, i in zip(problems, ids)
    ]


def build_arith_tokenizer():
    """The character-level tokenizer of the task (a ``PreTrainedTokenizerFast``; see module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join characters back without separators
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, EOS, UNK)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK)


def tiny_qwen2_config(tiny: TinyModelConfig, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """A Qwen2 ``config.json`` dict of the ``tiny`` shapes (fp32, no dropout, SiLU, RMSNorm eps 1e-6).

    ``vocab_size`` is rounded up to a multiple of 16. Both spellings of the RoPE base are written
    (``rope_theta`` and transformers 5's ``rope_parameters``) for readers of either generation.
    """
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": -(-vocab_size // 16) * 16,
        "hidden_size": tiny.hidden_size,
        "intermediate_size": tiny.intermediate_size,
        "num_hidden_layers": tiny.num_layers,
        "num_attention_heads": tiny.num_attention_heads,
        "num_key_value_heads": tiny.num_key_value_heads,
        "max_position_embeddings": tiny.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": tiny.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_sliding_window": False,
        "sliding_window": None,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }


def tiny_model_config(tiny: TinyModelConfig, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """``config.json`` of ``tiny.architecture``: the Qwen2 one, or Qwen3 / Qwen3-MoE fields over it."""
    cfg = tiny_qwen2_config(tiny, vocab_size, eos_id, pad_id)
    if tiny.architecture == "qwen2":
        return cfg
    for k in ("use_sliding_window", "sliding_window"):
        cfg.pop(k)
    cfg.update(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        head_dim=tiny.hidden_size // tiny.num_attention_heads,
        attention_bias=False,
    )
    if tiny.architecture == "qwen3_moe":
        cfg.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=tiny.num_experts,
            num_experts_per_tok=tiny.num_experts_per_tok,
            moe_intermediate_size=tiny.moe_intermediate_size or tiny.intermediate_size // tiny.num_experts_per_tok,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
        )
    return cfg


def write_tiny_model_dir(path: str | Path, tiny: TinyModelConfig) -> Path:
    """Write the task tokenizer and a tiny ``config.json`` (no weights) of ``tiny.architecture`` to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_arith_tokenizer()
    tok.save_pretrained(str(path))
    cfg = tiny_model_config(tiny, len(tok), tok.eos_token_id, tok.pad_token_id)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def format_warmup_examples(
    records: Sequence[PromptRecord], rng: random.Random, max_digits: int = 1, min_digits: int = 1
) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, target_ids)`` pairs for the supervised *format* warm-up.

    The target is ``min_digits``..``max_digits`` digits (the length uniform, independent of the
    prompt), each drawn uniformly from 0-9, then EOS: it teaches "answer with digits, then stop",
    never which digits nor how many this answer has (for the one-digit answers of the CPU default,
    one uniformly random digit; for zero-padded answers, always the padded width). The RL run
    therefore still starts at chance accuracy.

    Example:
        >>> rec = PromptRecord("a", "3+5=", "3+5=", (6, 13, 8, 14), "8", "arith")
        >>> [(p, len(t), t[-1]) for p, t in format_warmup_examples([rec], random.Random(0))]
        [([6, 13, 8, 14], 2, 1)]
    """
    out = []
    for r in records:
        # No draw for one-digit tasks: the CPU default's warm-up stream stays what it was.
        n = rng.randint(min_digits, max_digits) if max_digits > min_digits else max_digits
        out.append((list(r.prompt_ids), [DIGIT_IDS[rng.randrange(10)] for _ in range(n)] + [EOS_ID]))
    return out
