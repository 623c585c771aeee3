"""A real two-node Ray cluster on this machine for the launcher and reward-backend tests.

``ray.cluster_utils.Cluster`` starts a head and a worker raylet ("nodes" with distinct node ids) on
one machine: 1 CPU each and a small object store, so ``STRICT_SPREAD`` must use both. Every port is
picked free (other jobs run Ray on the same machine). Start-up is about 9 s and 1.4 GB, so the
session fixture in ``tests/conftest.py`` starts it once, on first use, and shuts it down at the end.
"""

from __future__ import annotations

import os

from pacs_megatron.utils.dist import free_port

_OBJECT_STORE = 100 * 2**20


def _node_args() -> dict:
    return {
        "num_cpus": 1,
        "object_store_memory": _OBJECT_STORE,
        "dashboard_agent_listen_port": free_port(),
        "metrics_export_port": free_port(),
        "runtime_env_agent_port": free_port(),
        "metrics_agent_port": free_port(),
    }


def start_two_node_cluster():
    """Head + one worker node; returns the ``Cluster`` (its ``.address`` is the GCS HOST:PORT)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"  # also inherited by the drivers the tests start
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.cluster_utils import Cluster

    head = _node_args() | {
        "gcs_server_port": free_port(),
        "include_dashboard": False,
        "ray_client_server_port": free_port(),
    }
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(**_node_args())
    cluster.wait_for_nodes()
    return cluster
