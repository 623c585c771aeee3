"""A character-level tokenizer over printable ASCII with ChatML specials and template: tool calls, JSON and
tool output can be written with it (the arithmetic task's tokenizer has digits and + = only)."""

from __future__ import annotations

import string

CHATML = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
SPECIALS = ("<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>")


def ascii_tokenizer(chat_template: str | None = CHATML):
    """One token per printable character (newline included); ``<|im_end|>`` is EOS, ``<|endoftext|>`` pad."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate([*SPECIALS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    out.chat_template = chat_template
    return out


def write_ascii_model(path, max_positions: int = 512, seed: int = 0) -> str:
    """A random tiny Qwen2 (hidden 128, 2 layers) over :func:`ascii_tokenizer`, saved with its tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = ascii_tokenizer()
    cfg = Qwen2Config(
        vocab_size=-(-len(tok) // 16) * 16,
        hidden_size=128,  # head_dim 32: vLLM's CPU attention has no kernel for 16
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)
