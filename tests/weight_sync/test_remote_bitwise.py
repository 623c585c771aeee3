"""The bitwise check with engines on their own processes (rollout.placement=separate), for real: this process is
trainer rank 0 of a world of one, one ``python -m pacs_megatron.launch.engine_rank`` HF engine process, the
weights over the gloo weight group. The engine fingerprints what arrived (the trainer compares it with what it
sent: the transport) and what it holds after the load (against what arrived, cast to its dtype: the load).

A correct sync passes; a load planted wrong at version 1 (PACS_ENGINE_STALE_TENSOR) raises WeightSyncError naming
the tensor, engine and version, though the probe of random tokens would not have caught it (the probe is off here);
the next correct version passes again.
"""

from __future__ import annotations

from datetime import timedelta

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

    def move(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.hf.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def test_a_planted_bad_load_on_an_engine_process_is_named(tmp_path, monkeypatch):
    from torch.distributed import TCPStore

    from pacs_megatron.data import load_tokenizer

    model_dir = saved_model(tmp_path / "model", tied=True)
    cfg = load_config(
        None,
        [f"model.path={model_dir}", "data.max_prompt_length=16", "rollout.max_response_length=6"]
        + ["rollout.placement=separate", "rollout.engines=1", "rollout.engine_timeout_s=600"]
        + ["sync.probe_sequences=0", "model.dtype=bfloat16"],  # the bitwise check alone; a bf16 engine
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
    sync = RemoteWeightSync(actor, client, cfg.sync, vocab, torch.float32, cfg.rollout, "cpu")
    try:
        actor.move(seed=1)
        result = sync.sync(version=0, wait=True)  # fp32 on the wire, cast by the bf16 engine on its copy
        assert result.bitwise_tensors == len(actor.hf.model.state_dict()) - 1  # all but the tied alias lm_head
        assert result.bitwise_seconds >= 0
        actor.move(seed=2)
        with pytest.raises(WeightSyncError, match=rf"engine 0, version 1.*{STALE.replace('.', '[.]')} differ"):
            sync.sync(version=1, wait=True)
        actor.move(seed=3)
        sync.sync(version=2, wait=True)  # a correct load passes again
    finally:
        client.close()
        for p in procs:
            try:
                p.wait(60)
            except Exception:  # noqa: BLE001
                p.kill()
        del store
