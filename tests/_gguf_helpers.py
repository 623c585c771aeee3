"""A tiny random Llama written as a GGUF file with the ``gguf`` package, as llama.cpp's converter would.

The tokenizer is byte-level BPE ("gpt2" in GGUF terms): the 256 byte symbols, a few merges and three
control tokens (ChatML's ``<|im_start|>`` / ``<|im_end|>`` and ``<|endoftext|>``), so the model's vocabulary
is exactly the token list. Q and K rows are permuted the way llama.cpp stores them (transformers
reverses it on load), so a missed permutation would change the logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he", "1 2", "+ =")
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merged = ["".join(m.split(" ")) for m in MERGES]
    return list(SPECIALS) + symbols + merged


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``permute`` (rotary halves -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(layers: int = 2, tie: bool = True, seed: int = 0):
    """A random transformers Llama (hidden 64, 4 heads, 2 KV heads) whose vocab is the GGUF token list."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(_tokens()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1: random ones exercise their mapping
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def write_gguf(model, path: Path, qtype: str = "F32", chat_template: bool = True) -> Path:
    """``model`` (tiny_llama) as a GGUF file; ``qtype`` "F32" or a type gguf can quantize to ("Q8_0",
    "Q4_1", ...), applied to the 2-D projection weights (norms stay F32, as llama.cpp keeps them)."""
    import gguf

    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-test")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    tokens = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    if chat_template:
        w.add_chat_template(TEMPLATE)

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    state = model.state_dict()
    for hf_name, gg_name in names.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = state[hf_name].float().numpy()
        if gg_name.endswith("attn_q.weight"):
            data = _permute(data, heads)
        elif gg_name.endswith("attn_k.weight"):
            data = _permute(data, kv)
        if qtype != "F32" and data.ndim == 2:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gg_name, gguf.quants.quantize(data, q), raw_dtype=q)
        else:
            w.add_tensor(gg_name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
