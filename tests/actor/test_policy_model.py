"""``build_policy_model`` (actor/policy_model.py) builds what MegatronActor and ``export`` built by hand before
(issue 60, R5): the same parameter names, values and frozen flags, with and without LoRA, from a loaded or a
drawn base, and the caller's RNG as it was. Export used to attach its adapters with seed 0 and no dropout; the
builder passes the run's: only A's init differs, and the checkpoint's entries (the same keys) overwrite it.
"""

from __future__ import annotations

import pytest
import torch
from _actor_helpers import hf_config, make_qwen2, run_config
from _dist import run_distributed

from pacs_megatron.config import LoRAConfig

SEED = 1234
LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.1, targets=["linear_qkv", "linear_fc2"])


def _by_hand(spec, groups, lora, base_dir, *, seed=SEED, export=False):
    """The construction lines MegatronActor.__init__ (or, ``export``, tools/export.py run()) held before."""
    from pacs_megatron.actor.lora.adapters import apply_lora
    from pacs_megatron.actor.model import build_model_chunks, seed_for_init, transformer_config
    from pacs_megatron.actor.weights import load_hf_weights

    config = transformer_config(spec, groups, torch.float32, False, False, routing_replay=False)
    with torch.random.fork_rng(devices=[]):
        seed_for_init(seed, False)
        chunks = build_model_chunks(spec, config, groups, local_spec=lora is not None)
    if base_dir is not None:
        load_hf_weights(chunks, spec, base_dir, groups)
    for c in chunks if lora is not None else []:
        if export:
            apply_lora(c, lora.targets, lora.rank, lora.alpha, tp_rank=groups.tp_rank, tp_size=groups.tp_size)
        else:
            apply_lora(
                c,
                lora.targets,
                lora.rank,
                lora.alpha,
                lora.dropout,
                seed=seed,
                tp_rank=groups.tp_rank,
                tp_size=groups.tp_size,
            )
    return chunks


def _params(chunks):
    return {n: (p.detach().clone(), p.requires_grad) for c in chunks for n, p in c.named_parameters()}


def _body(rank, world, model_dir):
    from transformers import AutoConfig

    from pacs_megatron.actor.policy_model import build_policy_model
    from pacs_megatron.hf.spec import model_spec_from_hf
    from pacs_megatron.parallel import initialize_parallel

    groups = initialize_parallel(run_config(model_dir).parallel, hf_config(model_dir))
    spec = model_spec_from_hf(AutoConfig.from_pretrained(model_dir))
    out = {}
    for name, lora, base_dir in (("plain", None, model_dir), ("lora", LORA, model_dir), ("lora_drawn", LORA, None)):
        torch.manual_seed(7)
        rng = torch.get_rng_state()
        _, chunks = build_policy_model(spec, groups, torch.float32, seed=SEED, lora=lora, base_dir=base_dir)
        rng_kept = torch.equal(rng, torch.get_rng_state())
        out[name] = (_params(_by_hand(spec, groups, lora, base_dir)), _params(chunks), rng_kept)
    old = _by_hand(spec, groups, LORA, None, seed=SEED, export=True)
    _, new = build_policy_model(spec, groups, torch.float32, seed=SEED, lora=LORA)
    out["export"] = (_params(old), _params(new), [sorted(c.sharded_state_dict()) for c in (*old, *new)])
    return out


@pytest.mark.distributed
def test_the_builder_gives_the_hand_built_chunks(tmp_path):
    out = run_distributed(_body, 1, make_qwen2(tmp_path / "m", layers=2))[0]
    for name in ("plain", "lora", "lora_drawn"):
        before, after, rng_kept = out[name]
        assert list(before) == list(after), name
        assert all(before[n][1] == after[n][1] and torch.equal(before[n][0], after[n][0]) for n in before), name
        assert rng_kept, name
    assert not any(".lora_" in n for n in out["plain"][1])
    assert all(flag == (".lora_" in n) for n, (_, flag) in out["lora"][1].items())
    # export: the same entries to load, the same base; A's init differs (seed 0 before), the checkpoint's wins
    before, after, keys = out["export"]
    assert list(before) == list(after) and keys[0] == keys[1]
    assert all(torch.equal(before[n][0], after[n][0]) for n in before if not n.endswith(".lora_a"))
    assert any(not torch.equal(before[n][0], after[n][0]) for n in before if n.endswith(".lora_a"))
