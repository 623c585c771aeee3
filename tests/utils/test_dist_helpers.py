"""Sharded map over ranks, the local spawner, and free ports."""

import random
import socket

import pytest
from _dist import run_distributed

from pacs_megatron.launch.local import spawn_local
from pacs_megatron.utils.dist import _ephemeral_start, free_ports, map_sharded, shard_bounds


def test_shard_bounds_cover_everything():
    for n in range(0, 12):
        for size in (1, 2, 3, 5):
            spans = [shard_bounds(n, r, size) for r in range(size)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def _body(rank, world):
    items = list(range(7))
    plain = map_sharded(items, lambda part: [x * x for x in part])
    # two ranks forming one worker (as a TP-2 engine would): one copy of its results is kept
    grouped = map_sharded(items, lambda part: [x + 100 for x in part], rank=0, size=1)
    return plain, grouped


@pytest.mark.distributed
def test_map_sharded_two_ranks():
    for plain, grouped in run_distributed(_body, 2):
        assert plain == [x * x for x in range(7)]
        assert grouped == [x + 100 for x in range(7)]


@pytest.mark.subprocess
def test_spawn_local_reports_failure(tmp_path, monkeypatch):
    code = spawn_local(["pacs_megatron.utils._spawn_probe_missing_module"], 2)
    assert code != 0
    script = tmp_path / "ok.py"
    script.write_text("import os, sys\nsys.exit(0 if os.environ['WORLD_SIZE'] == '2' else 3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert spawn_local(["ok"], 2) == 0


def test_free_ports_are_distinct_free_and_outside_the_ephemeral_range():
    """200 at once: picked one at a time (kernel's or random), a repeat among 200 is likelier than not."""
    ports = free_ports(200)
    assert len(set(ports)) == 200
    assert all(20000 <= p < _ephemeral_start() for p in ports), ports
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("", p))  # free on every interface once returned
    random.seed(0)  # the seedable generator plays no part: two processes seeded alike draw different ports
    first = free_ports(4)
    random.seed(0)
    assert free_ports(4) != first
