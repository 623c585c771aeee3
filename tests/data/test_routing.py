"""MoE routing replay records (data/routing.py): compact, unpadded, and held per rank.

The distributed test runs the trainer's own stages (``collect_batch`` with a recording engine,
``prepare_local_batch``) on 2 gloo ranks with Qwen3-30B-A3B-sized records (48 layers, top-8 of 128
experts) and bounds the routing bytes each rank holds: its engine replica's rows (until the step's batch
is dropped) plus the rows it trains on, at one byte per expert id. It also checks that every rank got
the right records for its rows. The same launch runs the stages again with the engines on their own
processes (``rollout.placement=separate``: the real ``RemoteEngines.collect``, its two engines answering
in-process on rank 0): rank 0 receives every record, and each must then go only to the rank that trains
its row, never be broadcast to every rank (issue #40 R4).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from _dist import run_distributed

from pacs_megatron.batch.build import build_rollouts
from pacs_megatron.data.records import PromptRecord
from pacs_megatron.rollout.base import EngineTraits
from pacs_megatron.rollout.collect import ShardedSteps
from pacs_megatron.rollout.remote.engines import Inbox, RemoteEngines
from pacs_megatron.rollout.remote.protocol import Result
from pacs_megatron.rollout.types import Response
from pacs_megatron.utils.dist import rank_and_world, shard_bounds

LAYERS, TOPK, EXPERTS = 48, 8, 128
N, PROMPTS = 2, 16


def expected_record(prompt: tuple[int, ...], j: int, length: int) -> torch.Tensor:
    """The experts the fake engine routes token t of response j of ``prompt`` to: k distinct ids."""
    t = torch.arange(length)[:, None, None]
    layer = torch.arange(LAYERS)[None, :, None]
    base = (sum(prompt) * 7 + j * 13 + t * 3 + layer) % 16
    return ((base + 16 * torch.arange(TOPK)) % EXPERTS).to(torch.int16)


class RecordingEngine(ShardedSteps):
    """Responses of prompt-dependent lengths, each with its routing record (int16, as the engines give); a
    replica per rank, as the HF engine."""

    def traits(self) -> EngineTraits:
        return EngineTraits(*rank_and_world())

    def generate(self, prompts, sampling):
        out = []
        for p in prompts:
            group = []
            for j in range(sampling.n):
                tokens = tuple([3] * (2 + (sum(p) + j) % 7))
                rec = expected_record(tuple(p), j, len(p) + len(tokens))
                group.append(Response(tokens, "x", "stop", logprobs=(-0.5,) * len(tokens), routed_experts=rec))
            out.append(group)
        return out


class RecordingRemote(RemoteEngines):
    """``rollout.placement=separate`` as the trainer ranks see it, without engine processes: on rank 0
    each of two "engines" answers its share of a Generate with :class:`RecordingEngine`'s responses, filed
    in the inbox as the reader threads file Results; :meth:`collect` is the real one."""

    def __init__(self, rank: int) -> None:  # no connections: nothing of the real __init__ applies
        self.rank, self.count, self.inbox = rank, 2, Inbox(2)
        self._tags = itertools.count()

    def submit(self, tag, prompt_ids, sampling, step) -> None:
        if self.rank != 0:
            return
        for e in range(self.count):
            lo, hi = shard_bounds(len(prompt_ids), e, self.count)
            groups = RecordingEngine().generate(prompt_ids[lo:hi], sampling)
            self.inbox.put(Result(engine=e, tag=tag, groups=groups, version=0))


class FakeActor:
    reference = None  # no reference policy (actor/reference.py)

    def compute_logprobs(
        self, batch, micro_batch_size, temperature, with_entropy=False, mini_batch_groups=0, response_only=False
    ):
        zeros = torch.zeros(batch.input_ids.shape)
        return SimpleNamespace(token_logp=zeros, entropy=zeros)


class FakeScorer:
    last_error = ""
    guard = SimpleNamespace(update=lambda *a: None)

    def score(self, prompts, responses, answers, extras):
        return [float(i % 2) for i in range(len(prompts))], {}


def _routing_bytes(x) -> int:
    """Routing bytes held by a batch field or the gathered responses (a tensor, RoutedExperts, or records)."""
    if x is None:
        return 0
    if isinstance(x, list):
        return sum(_routing_bytes(r.routed_experts) for g in x for r in g)
    return int(x.nbytes)


def _body(rank, world):
    """Both placements in one launch: ``{"colocated": bytes..., "separate": bytes...}`` of this rank."""
    return {
        "colocated": _stages(rank, world, RecordingEngine()),
        "separate": _stages(rank, world, RecordingRemote(rank)),
    }


def _stages(rank, world, engine):
    from pacs_megatron.config import load_config
    from pacs_megatron.loop import stages, update_stages

    cfg = load_config(
        None,
        [
            "model.path=/m",
            "actor.routing_replay=rollout",
            f"rollout.n={N}",
            f"trainer.train_batch_size={PROMPTS}",
            f"algorithm.mini_batch_size={PROMPTS // 2}",
            f"parallel.dp={world}",
            "algorithm.micro_batch_size=2",
            "algorithm.logprob_micro_batch_size=2",
        ],
    )
    prompts = [tuple(range(1 + i % 5, 6 + i % 3 + i % 5)) for i in range(PROMPTS)]
    records = [PromptRecord(f"p{i}", "q", "q", p, "1", "t") for i, p in enumerate(prompts)]
    gathered = engine.generate_step([r.prompt_ids for r in records], stages.train_sampling(cfg), 1)
    c = SimpleNamespace(engine=engine, scorer=FakeScorer(), pad_id=0)
    batch, _, _ = stages.collect_batch(cfg, c, records, 1)
    local, _, _ = update_stages.prepare_local_batch(cfg, FakeActor(), batch, rank, world)
    got = local.routed_experts
    assert got is not None and len(got) == len(local)
    for j, gid in enumerate(local.group_ids.tolist()):  # the right record for every row this rank trains on
        length = int(local.seq_lens[j])
        mine = got[j, :length] if isinstance(got, torch.Tensor) else got.records[j]
        p = prompts[gid]
        sample = (length - len(p) - 2 - sum(p)) % 7  # the response length tells which of the n it is
        assert torch.equal(mine.long(), expected_record(p, sample, length).long()), (gid, j)
    return {
        "gathered": _routing_bytes(gathered),
        "batch": _routing_bytes(batch.routed_experts),
        "local": _routing_bytes(got),
        "local_tokens": int(local.seq_lens.sum()),
        "all_tokens": int(batch.seq_lens.sum()),
    }


@pytest.mark.distributed
def test_routing_bytes_per_rank_are_bounded():
    world = 2
    both = run_distributed(_body, world)
    per_token = LAYERS * TOPK  # one byte per expert id
    results = [b["colocated"] for b in both]
    total = results[0]["all_tokens"] * per_token  # the step's records, compact
    for rank, b in enumerate(both):  # separate engines: rank 0 received every record, and keeps them
        r = b["separate"]
        assert r["local"] == r["local_tokens"] * per_token, "separate: the rows a rank trains on"
        if rank > 0:
            assert r["gathered"] == r["batch"] == 0, "separate: records broadcast to a rank that does not train them"
    for r in results:
        own = r["local_tokens"] * per_token
        assert r["local"] == own, "the rows a rank trains on, one byte per expert id"
        # this replica's generated rows (half of the prompts) and nothing of the other's
        assert r["batch"] <= total / world * 1.5, "the step's batch holds other replicas' records"
        assert r["gathered"] <= 2 * total / world * 1.5, "gathered responses carry other replicas' records"
        assert r["batch"] + r["local"] <= 3 * total / world, "routing bytes held per rank"


def test_compact_records_and_micro_batch_padding():
    from pacs_megatron.data.routing import RoutedExperts, compact, fetch_routed_experts

    rec = [torch.tensor([[[3, 1]], [[2, 0]]]), torch.tensor([[[1, 2]]]), torch.tensor([[[300, 5]]])]
    r = RoutedExperts.from_records(rec[:2])
    assert all(x.dtype == torch.uint8 for x in r.records) and compact(rec[2]).dtype == torch.int16
    assert r.nbytes == 6
    pad = r.padded(3)
    assert pad.dtype == torch.uint8 and pad.shape == (2, 3, 1, 2)
    assert pad[:, :, 0].tolist() == [[[3, 1], [2, 0], [0, 1]], [[1, 2], [0, 1], [0, 1]]]
    # row selections of a TrainBatch carry the records along; to(device) leaves them on the host
    batch = replace(build_rollouts([[5], [5]], [[7], []], [1.0, 0.0], group_size=1, pad_id=0), routed_experts=r)
    assert batch.rows(1, 2).routed_experts.rows.tolist() == [1]
    assert batch.take(torch.tensor([1, 0])).routed_experts.records[1] is r.records[0]
    assert batch.to("cpu").routed_experts is r
    with pytest.raises(RuntimeError, match=r"rows \[1\] have no routing record"):
        RoutedExperts(torch.arange(2), (rec[0], None)).padded(2)
    # one process: fetching needs no exchange, and a row nobody holds is an error
    assert fetch_routed_experts(r, r.take(torch.tensor([1]))).records[0] is r.records[1]
    with pytest.raises(RuntimeError, match=r"no rank holds the routing records of rows \[1\]"):
        fetch_routed_experts(RoutedExperts(torch.arange(2), (rec[0], None)), r)
