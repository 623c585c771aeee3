"""The bitwise weight check (rollout/weight_checksum.py, WeightSync.check_bitwise), colocated with the HF engine:

(a) the fingerprint: exact, independent of the reduction order, composable over dim-0 concatenation (vLLM's
    fused qkv / gate_up) and blind only to the sign of zero;
(b) a correct sync passes and counts every tensor, in float32 and with an fp32 actor into a bf16 engine
    (the engine casts on its copy: the sender fingerprints the same cast);
(c) a planted stale tensor (the engine keeps one tensor's old value) fails the sync naming that tensor, on a
    sync whose log-prob probe is switched off, and with verify_bitwise off it is not checked.
The stale-layer case the bf16 probe passes is in test_probe_stale_layer.py; vLLM in tests/rollout/test_vllm_reload.py;
engines on their own processes in test_remote_bitwise.py.
"""

from __future__ import annotations

import pytest
import torch

from pacs_megatron.config import SyncConfig, TinyModelConfig
from pacs_megatron.rollout.weight_checksum import Checksum, Held, checksum, combine, compare, row_sums
from pacs_megatron.weight_sync import WeightSync, WeightSyncError


def test_the_fingerprint_is_exact_and_composes_over_fused_rows():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(r, 8, generator=g).to(torch.bfloat16) for r in (6, 2, 2))
    fused = torch.cat([q, k, v])
    assert combine([checksum(q), checksum(k), checksum(v)]) == checksum(fused)
    assert combine([checksum(k), checksum(q), checksum(v)]) != checksum(fused)  # a q/k mix-up: same values
    flipped = fused.clone()
    flipped.view(torch.int16)[3, 5] ^= 1  # one bit of one element
    assert checksum(flipped) != checksum(fused)
    swapped = fused.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # two rows exchanged: the plain sum is blind to it, the weighted one is not
    assert checksum(swapped).total == checksum(fused).total and checksum(swapped) != checksum(fused)
    # any reduction order, the same integers: column sums of the transpose == row sums
    assert torch.equal(row_sums(fused), row_sums(fused.t().contiguous().t()))
    x = torch.randn(5, 3, generator=g)
    assert checksum(x, torch.bfloat16) == checksum(x.to(torch.bfloat16))  # the engine's cast, reproduced
    assert checksum(torch.tensor([-0.0, 1.0])) == checksum(torch.tensor([0.0, 1.0]))
    assert checksum(torch.tensor(2.5)).rows == 1 and checksum(torch.arange(4)).rows == 4


def test_compare_names_the_differing_tensor_and_what_is_not_covered():
    sent = {"a.q": Checksum(2, 5, 7), "a.k": Checksum(1, 3, 3), "norm": Checksum(4, 1, 1)}
    sent["experts.0"] = Checksum(1, 1, 1)
    held = [
        Held("a.qkv", ("a.q", "a.k"), combine([sent["a.q"], sent["a.k"]])),
        Held("norm", ("norm",), Checksum(4, 1, 2)),
        Held("rotary.cache", ("rotary.cache",), Checksum(1, 0, 0)),  # no HF counterpart: not compared
    ]
    bad, unverified = compare(sent, held)
    assert bad == ["norm"] and unverified == ["experts.0"]
    held[0] = Held("a.qkv", ("a.q", "a.k"), Checksum(3, 8, 99))
    assert compare(sent, held)[0][0] == "a.qkv (= a.q + a.k)"


class Actor:
    """The trainer's side of a sync: an HF model's state exported as it is (no probe)."""

    def __init__(self, model):
        self.model = model

    def export_hf_weights(self):
        yield from ((n, t.detach()) for n, t in self.model.state_dict().items())


class KeepsOneStale:
    """A load bug: the engine receives every tensor but keeps its old value of ``name``."""

    def __init__(self, engine, name: str):
        self.engine, self.name = engine, name
        self.traits, self.weight_checksums, self.logprobs = engine.traits, engine.weight_checksums, engine.logprobs

    def update_weights(self, buckets):
        old = self.engine._params[self.name].detach().clone()
        return self.engine.update_weights([[(n, old if n == self.name else t) for n, t in b] for b in buckets])


@pytest.fixture
def pair(tmp_path):
    """(HFEngine in bf16, an fp32 actor whose weights differ from the engine's) on an untied tiny Qwen2."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pacs_megatron.data.synthetic import write_tiny_model_dir
    from pacs_megatron.rollout.hf_engine import HFEngine

    model_dir = write_tiny_model_dir(tmp_path / "m", TinyModelConfig(tie_word_embeddings=False))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir))).save_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the actor trained: the engine still holds the start
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return HFEngine(model_dir, tok, dtype=torch.bfloat16, seed=0), Actor(model)


def test_a_correct_sync_passes_and_a_planted_stale_tensor_is_named(pair):
    engine, actor = pair
    cfg = SyncConfig(probe_sequences=0)  # the bitwise check alone
    result = WeightSync(actor, engine, cfg, 64, torch.float32).sync()
    n = len(actor.model.state_dict())
    assert result.bitwise_tensors == n and result.bitwise_seconds >= 0
    assert result.metrics()["sync/bitwise_tensors"] == n
    with torch.no_grad():
        actor.model.model.layers[1].mlp.down_proj.weight.add_(1e-2)  # the next step changes it
    stale = KeepsOneStale(engine, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(WeightSyncError, match=r"model\.layers\.1\.mlp\.down_proj\.weight differ"):
        WeightSync(actor, stale, cfg, 64, torch.float32).sync()
    off = SyncConfig(probe_sequences=0, verify_bitwise=False)
    assert WeightSync(actor, stale, off, 64, torch.float32).sync().bitwise_tensors == 0  # not checked
    assert WeightSync(actor, engine, cfg, 64, torch.float32).sync().bitwise_tensors == n  # repaired


def test_a_stale_bf16_rounding_is_caught(pair):
    """The smallest possible error: one element one bf16 ulp off, in a tensor of 4096."""
    engine, actor = pair
    cfg = SyncConfig(probe_sequences=0)
    WeightSync(actor, engine, cfg, 64, torch.float32).sync()
    name = "model.layers.0.self_attn.q_proj.weight"

    class OneUlp(KeepsOneStale):
        def update_weights(self, buckets):
            def nudged(n, t):
                if n != self.name:
                    return t
                t = t.to(torch.bfloat16).clone()
                t.view(torch.int16)[0, 0] += 1
                return t

            return self.engine.update_weights([[(n, nudged(n, t)) for n, t in b] for b in buckets])

    with pytest.raises(WeightSyncError, match=r"q_proj\.weight differ"):
        WeightSync(actor, OneUlp(engine, name), cfg, 64, torch.float32).sync()
