"""The bitwise check with engines on their own processes (rollout.placement=separate), for real: this process is
trainer rank 0 of a world of one, one ``python -m pacs_megatron.launch.engine_rank`` HF engine process, the
weights over the gloo weight group. The engine fingerprints what arrived (the trainer compares it with what it
sent: the transport) and what it holds after the load (against what arrived, cast to its dtype: the load).

A correct sync passes; a load planted wrong at version 1 (PACS_ENGINE_STALE_TENSOR) raises WeightSyncError naming
the tensor, engine and version (the probe is off: the check alone); the next correct version passes again.
The engine-side probe's greedy bound applies from the second version on.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from _vllm import saved_model
from omegaconf import OmegaConf

from pacs_megatron.config import load_config
from pacs_megatron.launch.engine_rank import spawn_engines
from pacs_megatron.rollout.hf_engine import HFEngine
from pacs_megatron.rollout.remote import RemoteEngines
from pacs_megatron.rollout.server import STALE_ENV
from pacs_megatron.utils.dist import free_port
from pacs_megatron.weight_sync import WeightSyncError
from pacs_megatron.weight_sync.remote import RemoteWeightSync

pytestmark = pytest.mark.distributed
STALE = "model.layers.1.self_attn.v_proj.bias"


class Actor:
    """The trainer's side: an HF model's state, exported as it is, moved between versions."""

    def __init__(self, model_dir, tokenizer) -> None:
        self.hf = HFEngine(model_dir, tokenizer, dtype=torch.float32)

    def export_hf_weights(self):
        yield from self.hf.model.state_dict().items()

    def compute_logprobs(self, batch, micro_batch_size, temperature):
        seqs = [row[: int(n)].tolist() for row, n in zip(batch.input_ids, batch.seq_lens)]
        out = torch.zeros(batch.input_ids.shape)
        for b, lp in enumerate(self.hf.logprobs(seqs, temperature)):
            out[b, 1 : 1 + len(lp)] = lp
        return SimpleNamespace(token_logp=out)

    def move(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.hf.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))


@contextmanager
def remote(tmp_path, monkeypatch, *overrides: str):
    """(RemoteWeightSync, Actor) over one HF engine process in bf16 (an fp32 actor: the engine casts)."""
    from torch.distributed import TCPStore

    from pacs_megatron.data import load_tokenizer

    model_dir = saved_model(tmp_path / "model", tied=True)
    cfg = load_config(
        None,
        [f"model.path={model_dir}", "data.max_prompt_length=16", "rollout.max_response_length=6"]
        + ["rollout.placement=separate", "rollout.engines=1", "rollout.engine_timeout_s=600", "model.dtype=bfloat16"]
        + list(overrides),
    )
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv(STALE_ENV, f"1:{STALE}")
    procs = spawn_engines(cfg, f"127.0.0.1:{port}", None, threads=1)
    actor = Actor(model_dir, load_tokenizer(str(model_dir), cfg.data.chat_template))
    client = RemoteEngines(cfg, model_dir, model_dir, OmegaConf.to_container(OmegaConf.structured(cfg)), "cpu")
    vocab = actor.hf.model.config.vocab_size
    try:
        yield RemoteWeightSync(actor, client, cfg.sync, vocab, torch.float32, cfg.rollout, "cpu"), actor
    finally:
        client.close()
        for p in procs:
            try:
                p.wait(60)
            except Exception:  # noqa: BLE001
                p.kill()
        del store


def test_a_planted_bad_load_on_an_engine_process_is_named(tmp_path, monkeypatch):
    with remote(tmp_path, monkeypatch, "sync.probe_sequences=0") as (sync, actor):  # the bitwise check alone
        actor.move(seed=1)
        result = sync.sync(version=0, wait=True)  # fp32 on the wire, cast by the bf16 engine on its copy
        assert result.bitwise_tensors == len(actor.hf.model.state_dict()) - 1  # all but the tied alias lm_head
        assert result.bitwise_seconds >= 0
        actor.move(seed=2)
        with pytest.raises(WeightSyncError, match=rf"engine 0, version 1.*{STALE.replace('.', '[.]')} differ"):
            sync.sync(version=1, wait=True)
        actor.move(seed=3)
        sync.sync(version=2, wait=True)  # a correct load passes again


def test_the_engine_side_probe_has_a_greedy_bound(tmp_path, monkeypatch):
    """From the second version on, the probe continues its prompts with the engine's greedy continuation of the
    version before, and the mean difference there is bounded (here a bound no bf16 engine meets: it raises)."""
    overrides = ("sync.verify_bitwise=false", "sync.probe_tolerance=1.0", "sync.probe_greedy_tolerance=1e-9")
    with remote(tmp_path, monkeypatch, *overrides) as (sync, actor):
        first = sync.sync(version=0, wait=True)
        assert math.isnan(first.greedy_logprob_diff) and sync.continuation is not None  # random tokens only
        actor.move(seed=2)
        with pytest.raises(WeightSyncError, match="greedy continuation"):
            sync.sync(version=1, wait=True)
