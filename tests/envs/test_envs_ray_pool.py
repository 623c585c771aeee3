"""tools.backend=ray: calls run as Ray tasks on a real two-node cluster and come back in input order (issue 45)."""

from __future__ import annotations

import pytest

from pacs_megatron.config.tools import ToolsConfig
from pacs_megatron.envs.pool import RayToolPool, make_pool


@pytest.mark.distributed
def test_the_ray_pool_matches_the_local_pool(ray_cluster, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    calls = [
        ("python", {"code": "print(123 * 456)"}),
        ("python", {"code": "import os\nprint(os.environ.get('RAY_ADDRESS'))"}),  # nothing of the worker's env
        ("python", {"code": "1/0"}),
        ("nope", {}),
        ("python", '{"code": "print(sum(range(10)))"}'),
    ]  # the limits are the sandbox tests' (test_envs_sandbox.py); here: the same answers, in order
    texts = {}
    for backend in ("local", "ray"):
        cfg = ToolsConfig(backend=backend, workers=2, wall_seconds=60, cpu_seconds=5, memory_mb=512)
        with make_pool(cfg) as pool:
            assert isinstance(pool, RayToolPool) == (backend == "ray")
            results = pool.run(calls)
        assert [r.kind for r in results] == ["ok", "ok", "error", "bad_call", "ok"], results
        texts[backend] = [r.text for r in results]
    assert texts["ray"] == texts["local"]
    assert texts["ray"][:2] == ["56088\n", "None\n"] and texts["ray"][4] == "45\n"
