"""Engine weights that force the next token, shared by the HF engine and stop-token tests."""

from __future__ import annotations


def force_next_token(engine, token_id: int, head_weight: float = 1.0):
    """Make an untied HF engine emit ``token_id`` with probability ~1 at every position; return it.

    The blocks' outputs are zeroed (the residual stream is the token embedding), every embedding is
    the ones vector (so the normed hidden state is ones), and only ``token_id``'s LM-head row is
    non-zero (``head_weight`` in every entry).
    """
    sd = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    for k, v in sd.items():
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            v.zero_()
    sd["model.embed_tokens.weight"].fill_(1.0)
    head = sd["lm_head.weight"].zero_()
    head[token_id] = head_weight
    engine.update_weights([list(sd.items())])
    return engine
