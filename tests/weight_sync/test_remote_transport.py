"""The weights' data plane to engines on other ranks (weight_sync/remote.py, issue 31 item 1), with real
processes: a gloo group of a "trainer" (rank 0) and two "engines", made from the job's TCPStore beside the
default group, as the trainer and engine processes do.

(a) pack / unpack: any dtype mix (bf16, int, 0-d) round-trips bit for bit through one byte buffer;
(b) two versions in buckets, sent by the sender thread only once both engines asked for each: the engines
    receive every tensor bit for bit, in order;
(c) a failure in the sender thread is raised by the trainer's next call.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from _dist import run_distributed

from pacs_megatron.rollout.remote.protocol import connect_store
from pacs_megatron.weight_sync import iter_buckets
from pacs_megatron.weight_sync.remote import WeightGroup, WeightSender, nbytes, pack, receive_buckets, unpack


def _named(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [
        ("embed", torch.randn(7, 5, generator=g)),
        ("norm", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("steps", torch.randint(0, 1 << 40, (3,), generator=g)),
        ("scale", torch.tensor(float(version))),
        ("head", torch.randn(4, 6, generator=g).half()),
    ]


def test_pack_and_unpack_round_trip_any_dtype_mix():
    named = _named(3)
    layout, buf = pack(named)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes(layout)
    assert all(off % 64 == 0 for *_, off in layout)
    out = unpack(layout, buf)
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert pack([])[0] == [] and nbytes([]) == 0


def _body(rank: int, world: int):
    store = connect_store(60.0)  # the default group's store (rank 0 hosts it), as the engines use the trainer's
    group = WeightGroup("gloo", store, rank, world, torch.device("cpu"), 60.0)
    if rank == 0:
        order = []

        def wanted(version):
            store.wait([f"t/wanted/{version}/{e}" for e in range(1, world)])
            order.append(version)

        sender = WeightSender(group, wanted)
        for version in (1, 2):
            layouts, bufs = zip(*(pack(b) for b in iter_buckets(_named(version), 128)))
            store.set(f"t/layout/{version}", pickle.dumps(list(layouts)))
            sender.send(version, list(bufs))  # returns at once: the engines have not asked yet
        sender.drain()
        return order
    got = {}
    for version in (1, 2):
        layouts = pickle.loads(store.get(f"t/layout/{version}"))
        store.set(f"t/wanted/{version}/{rank}", b"1")
        got[version] = [(n, t.clone()) for bucket in receive_buckets(group, layouts) for n, t in bucket]
    return got


@pytest.mark.distributed
def test_engines_receive_every_version_bit_for_bit_once_they_ask():
    trainer, *engines = run_distributed(_body, 3)
    assert trainer == [1, 2]
    for got in engines:
        for version in (1, 2):
            sent = _named(version)
            assert [n for n, _ in got[version]] == [n for n, _ in sent]
            assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(sent, got[version]))


def test_a_sender_failure_is_raised_by_the_next_call():
    class Group:
        def to_wire(self, buf):
            return buf

        def broadcast(self, buf):
            raise RuntimeError("peer gone")

    sender = WeightSender(Group(), wanted=lambda version: None)
    sender.send(1, [torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(RuntimeError, match="weight sender failed: peer gone"):
        sender.drain()
    with pytest.raises(RuntimeError, match="peer gone"):
        sender.send(2, [])
