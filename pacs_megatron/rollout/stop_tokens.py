"""The one set of stop tokens both rollout engines use.

vLLM 0.32 adds the EOS ids of ``generation_config.json`` to every request's stop tokens even with
``generation_config="vllm"`` (vllm/config/model.py reads them for ``SamplingParams.
update_from_generation_config``), while the HF engine stopped on the tokenizer's EOS only: on
Qwen2.5-Instruct (tokenizer EOS ``<|im_end|>``, generation config ``[<|im_end|>, <|endoftext|>]``) the two
engines ended responses differently. Now both stop on exactly :func:`resolve_stop_token_ids`:

- ``rollout.stop_token_ids`` when set (then exactly that list), else
- the tokenizer's EOS id together with every ``eos_token_id`` of ``MODEL/generation_config.json``.

The vLLM engine passes the set as ``stop_token_ids`` with ``ignore_eos=True``, which keeps vLLM from
adding its own EOS / generation-config ids (vllm/sampling_params.py), so the set is the whole rule there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def generation_config_eos(model_dir: str | Path) -> list[int]:
    """``eos_token_id`` (int or list) of ``model_dir/generation_config.json``; [] without the file."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def resolve_stop_token_ids(tokenizer, model_dir: str | Path, configured: Sequence[int] = ()) -> tuple[int, ...]:
    """Sorted stop token ids of a run (see the module docstring); raises if the set would be empty.

    Example:
        >>> from types import SimpleNamespace
        >>> resolve_stop_token_ids(SimpleNamespace(eos_token_id=2), "/nonexistent"), resolve_stop_token_ids(
        ...     SimpleNamespace(eos_token_id=2), "/nonexistent", [7, 5])
        ((2,), (5, 7))
    """
    if configured:
        return tuple(sorted({int(t) for t in configured}))
    ids = set(generation_config_eos(model_dir))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError(
            "no stop tokens: the tokenizer has no eos_token and MODEL/generation_config.json no eos_token_id; "
            "set rollout.stop_token_ids=[...]"
        )
    return tuple(sorted(ids))


def stop_string_cut(token_ids: Sequence[int], stops: Sequence[str], decode) -> int | None:
    """Length of the shortest prefix of ``token_ids`` whose text (``decode``, special tokens kept) contains one
    of ``stops``; None when the whole text contains none. Engines stop on strings as an optimisation; this
    cut is the rule (a token past the stop string would be a sample the turn loop never asked for).

    Binary search: whether a prefix's text holds a stop string only grows with the prefix.

    Example:
        >>> text = {1: "a", 2: "</", 3: "call>", 4: "b"}
        >>> stop_string_cut([1, 2, 3, 4], ["</call>"], lambda ids: "".join(text[i] for i in ids))
        3
    """
    if not stops or not any(s in decode(list(token_ids)) for s in stops):
        return None
    lo, hi = 1, len(token_ids)  # the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(list(token_ids[:mid])) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo
