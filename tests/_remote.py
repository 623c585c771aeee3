"""Engines on their own processes for tests (rollout.placement=separate, for real): this process is trainer rank 0
of a world of one, with ``python -m pacs_megatron.launch.engine_rank`` engine processes beside it and an HF model
standing in for the Megatron actor. Shared by tests/rollout/remote/test_remote_engines.py and
tests/weight_sync/test_remote_bitwise.py."""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace

import torch
from _vllm import saved_model
from omegaconf import OmegaConf

from pacs_megatron.config import load_config
from pacs_megatron.data import load_tokenizer
from pacs_megatron.launch.engine_rank import spawn_engines
from pacs_megatron.rollout.hf_engine import HFEngine
from pacs_megatron.rollout.remote.engines import RemoteEngines
from pacs_megatron.utils.dist import free_port
from pacs_megatron.weight_sync.remote import RemoteWeightSync


class RefActor:
    """The trainer's side of a sync in one process: an HF model exported as it is, and its log-probs."""

    def __init__(self, model_dir, tokenizer) -> None:
        self.hf = HFEngine(model_dir, tokenizer, dtype=torch.float32)
        self.corrupt: str | None = None
        self.groups = SimpleNamespace(rank=0, cp_rank=0)  # one process: rank 0, CP rank 0 (weight_sync/policy.py)

    def export_hf_weights(self):
        for name, t in self.hf.model.state_dict().items():
            yield name, (t + 0.5 if name == self.corrupt else t)

    def compute_logprobs(self, batch, micro_batch_size, temperature):
        seqs = [row[: int(n)].tolist() for row, n in zip(batch.input_ids, batch.seq_lens)]
        out = torch.zeros(batch.input_ids.shape)
        for b, lp in enumerate(self.hf.logprobs(seqs, temperature)):
            out[b, 1 : 1 + len(lp)] = lp
        return SimpleNamespace(token_logp=out)

    def move(self, seed: int, scale: float = 0.05) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.hf.model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g))


@contextmanager
def remote_engines(tmp_path, monkeypatch, engines: int, overrides: list[str], spawn_env: dict[str, str]):
    """(RemoteEngines, RemoteWeightSync, RefActor, cfg, engine processes) over ``engines`` real engine processes of
    a tiny tied model; ``spawn_env`` is set while the engines start (their test hooks) and removed after."""
    from torch.distributed import TCPStore

    model_dir = saved_model(tmp_path / "model", tied=True)
    cfg = load_config(
        None,
        [f"model.path={model_dir}", "data.max_prompt_length=16", "rollout.max_response_length=6"]
        + ["rollout.placement=separate", f"rollout.engines={engines}", "rollout.engine_timeout_s=600", *overrides],
    )
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    for key, value in spawn_env.items():
        monkeypatch.setenv(key, value)
    procs = spawn_engines(cfg, f"127.0.0.1:{port}", None, threads=1)
    for key in spawn_env:
        monkeypatch.delenv(key)
    actor = RefActor(model_dir, load_tokenizer(str(model_dir), cfg.data.chat_template))
    config = OmegaConf.to_container(OmegaConf.structured(cfg))
    client = RemoteEngines(cfg.rollout, model_dir, model_dir, config, torch.device("cpu"))
    vocab = actor.hf.model.config.vocab_size
    sync = RemoteWeightSync(actor, client, cfg.sync, vocab, torch.float32, cfg.rollout, "cpu")
    try:
        yield client, sync, actor, cfg, procs
    finally:
        client.close()
        for p in procs:
            try:
                p.wait(60)
            except Exception:  # noqa: BLE001
                p.kill()
        del store
