"""Weight sync under context parallelism (parallel.cp = 2): who exports, who loads, what the engines hold.

Colocated engines: every rank holds one (an HF engine per rank; vLLM, a worker per rank) and samples its share
of the prompts, CP ranks > 0 included, so every rank exports once per sync and its engine loads each tensor once.
Engines on their own ranks (rollout.placement=separate): trainer rank 0 alone sends, so a CP rank > 0 exports
nothing (it is in none of rank 0's TP and PP groups); the engines and the weight group are stood in for by
recorders. ``save_hf`` (rank 0 writes) likewise. The actor starts from weights B, the engines from A: after a
sync every engine holds B bit for bit, as at CP = 1; after a train step the engines of a CP group hold the same
bits, the remote stream and the saved checkpoint too, within fp32 tolerance of CP = 1. One launch per layout.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _dist import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "actor"))
from _actor_helpers import hf_config, make_qwen2, rel_update_diff, run_config, sample_batch  # noqa: E402

from pacs_megatron.batch.rows import as_train_batch
from pacs_megatron.rollout.hf_engine import HFEngine  # noqa: E402

pytestmark = pytest.mark.distributed

VOCAB = 255
# name -> (world size, tp, cp)
LAYOUTS = {"cp1": (1, 1, 1), "cp2": (2, 1, 2), "tp2cp2": (4, 2, 2)}


class _Counted:
    """The actor, counting the exports it runs (an export that is created but never iterated does no work)."""

    def __init__(self, actor) -> None:
        self.actor, self.exports = actor, 0

    def __getattr__(self, name: str):
        return getattr(self.actor, name)

    def export_hf_weights(self, dtype=None):
        self.exports += 1
        yield from self.actor.export_hf_weights(dtype)


class _CountedEngine(HFEngine):
    """An HF engine counting its loads and the tensors they carry."""

    loads = tensors = 0

    def update_weights(self, buckets):
        self.loads += 1

        def counted():
            for bucket in buckets:
                self.tensors += len(bucket)
                yield bucket

        return super().update_weights(counted())


class _Engines:
    """RemoteEngines as RemoteWeightSync sees them, without engine processes: trainer rank 0 records the
    layouts of the LoadWeights it would send."""

    backend, store, count, timeout_s = "gloo", None, 1, 60.0

    def __init__(self, rank: int) -> None:
        self.rank, self.layouts = rank, []

    def traits(self):
        from pacs_megatron.rollout.base import EngineTraits

        return EngineTraits()

    def send_load(self, version, layout, probe) -> None:
        self.layouts.append(layout)

    def wait_wanted(self, version) -> None:
        pass


class _Wire:
    """The weight group: records each buffer as the engines would receive it."""

    last: _Wire | None = None

    def __init__(self, *args) -> None:
        self.sent: list[torch.Tensor] = []
        _Wire.last = self

    def broadcast(self, buf: torch.Tensor) -> None:
        self.sent.append(buf.clone())

    def to_wire(self, buf: torch.Tensor) -> torch.Tensor:
        return buf


def _held(engine) -> dict:
    return {n: t.detach().clone() for n, t in engine.model.state_dict().items()}


def _body(rank, world, actor_dir, engine_dir, out_dir, tp, cp):
    import pacs_megatron.actor.weights as weights
    import pacs_megatron.weight_sync.remote as remote
    from pacs_megatron.data.synthetic import build_arith_tokenizer
    from pacs_megatron.loop.build import build_actor
    from pacs_megatron.parallel import initialize_parallel
    from pacs_megatron.weight_sync import WeightSync

    cfg = run_config(actor_dir, tp=tp)
    cfg = replace(cfg, parallel=replace(cfg.parallel, cp=cp))
    groups = initialize_parallel(cfg.parallel, hf_config(actor_dir))
    actor = _Counted(build_actor(cfg, groups, actor_dir))
    engine = _CountedEngine(engine_dir, build_arith_tokenizer(), dtype=torch.float32)
    sync = WeightSync(actor, engine, cfg.sync, VOCAB, actor.param_dtype)
    first = sync.sync()
    out = {"cp_rank": groups.cp_rank, "synced": _held(engine), "bitwise": first.bitwise_tensors}
    out["params"] = len(list(engine.model.parameters()))
    batch = sample_batch(VOCAB)
    old = actor.compute_logprobs(batch, micro_batch_size=4, temperature=1.0).token_logp
    actor.train_step(as_train_batch(batch, old))
    sync.sync()
    out |= {"stepped": _held(engine), "exports": actor.exports, "loads": engine.loads, "tensors": engine.tensors}

    remote.WeightGroup = _Wire
    engines = _Engines(groups.rank)
    remote_sync = remote.RemoteWeightSync(actor, engines, cfg.sync, VOCAB, actor.param_dtype, cfg.rollout, "cpu")
    before = actor.exports
    remote_sync.sync(version=1, wait=False)
    out["remote_exports"] = actor.exports - before
    if remote_sync.sender is not None:
        remote_sync.sender.drain()
        pairs = zip(engines.layouts[0], _Wire.last.sent)
        out["remote"] = {n: t.clone() for layout, buf in pairs for n, t in remote.unpack(layout, buf)}

    runs = []
    export = weights.export_hf_weights

    def counted(*args, **kwargs):
        runs.append(1)
        yield from export(*args, **kwargs)

    weights.export_hf_weights = counted
    actor.save_hf(out_dir)
    out["save_exports"] = len(runs)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(actor's weights B, engine's weights A): the same tiny Qwen2, B = A + noise."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("cp_sync")
    a = make_qwen2(root / "a", vocab=VOCAB, tie=True)
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(root / "b")
    return str(root / "b"), a


@pytest.fixture(scope="module")
def one(dirs, tmp_path_factory):
    return run_distributed(_body, 1, *dirs, str(tmp_path_factory.mktemp("hf1")), 1, 1)[0]


@pytest.mark.parametrize("layout", ["cp2", "tp2cp2"])
def test_each_engine_loads_once_and_one_cp_rank_sends(layout, dirs, one, tmp_path):
    from safetensors.torch import load_file

    world, tp, cp = LAYOUTS[layout]
    results = run_distributed(_body, world, *dirs, str(tmp_path / "hf"), tp, cp)
    want = load_file(str(Path(dirs[0]) / "model.safetensors"))
    params = one["params"]
    assert one["bitwise"] == params and one["exports"] == 2 and one["loads"] == 2
    for rank, r in enumerate(results):
        where = f"{layout} rank {rank} (cp rank {r['cp_rank']})"
        # every rank holds an engine: one export and one load per sync, each tensor once
        assert (r["exports"], r["loads"], r["tensors"]) == (2, 2, one["tensors"]), where
        assert r["bitwise"] == params, where
        for name, t in want.items():
            assert torch.equal(r["synced"][name], t), f"{where}: {name} is not B after the first sync"
            assert torch.equal(r["synced"][name], one["synced"][name]), where
        # the engines of a CP group hold the same bits after a step: the weights are replicated over CP
        head = results[0]["stepped"]
        assert all(torch.equal(r["stepped"][n], head[n]) for n in head), f"{where}: engines differ after a step"
        diff = rel_update_diff(one["synced"], one["stepped"], r["synced"], r["stepped"])
        assert diff <= 1e-4, f"{where}: the synced update differs from CP = 1 by {diff:.2e}"
        # engines on their own ranks: only CP rank 0 exports (rank 0 sends); save_hf likewise
        exported = 1 if r["cp_rank"] == 0 else 0
        assert (r["remote_exports"], r["save_exports"]) == (exported, exported), where
    sent = results[0]["remote"]
    assert set(sent) == set(want) and all(torch.equal(sent[n], results[0]["stepped"][n]) for n in sent)
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(saved[n], sent[n]) for n in saved)
