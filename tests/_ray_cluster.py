"""A real two-node Ray cluster on this machine for the launcher and reward-backend tests.

``ray.cluster_utils.Cluster`` starts a head and a worker raylet ("nodes" with distinct node ids) on
one machine: 1 CPU each and a small object store, so ``STRICT_SPREAD`` must use both. Start-up is
about 9 s and 1.4 GB, so the session fixture in ``tests/conftest.py`` starts it once, on first use,
and shuts it down at the end.

Every port a node would take at a fixed default (the dashboard's 8265, its agent's 52365, the client
server's 10001) or draw in Python (the agents' ports, in older Ray releases) is pinned, from ports
``free_ports`` (pacs_megatron/utils/dist.py) reserves at once per node: other jobs run Ray on the
same machine, and ports drawn one at a time can repeat, which Ray refuses ("Ray component
runtime_env_agent is trying to use a port number ... that is used by other components",
ray-project/ray#45484). The raylet's own ports and the workers' are port 0 (``Cluster`` sets no
worker range): bound by the kernel, in its ephemeral range, where none of the pinned ones lie.
"""

from __future__ import annotations

import os

from pacs_megatron.utils.dist import free_ports

_OBJECT_STORE = 100 * 2**20
AGENT_PORTS = ("runtime_env_agent_port", "metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")
"""Every node's agents: runtime env (HTTP), dashboard agent gRPC (Ray calls it the metrics agent;
``ray start --dashboard-agent-grpc-port``), Prometheus export, dashboard agent HTTP."""
HEAD_PORTS = ("gcs_server_port", "ray_client_server_port", "dashboard_port")


def node_args(head: bool) -> dict:
    """``Cluster`` arguments of one node: 1 CPU, a small object store, and its ports, pinned."""
    names = AGENT_PORTS + (HEAD_PORTS if head else ())
    return {"num_cpus": 1, "object_store_memory": _OBJECT_STORE} | dict(zip(names, free_ports(len(names))))


def ray_env() -> None:
    """What every Ray process of the tests inherits (the raylets, the drivers the tests start)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def start_two_node_cluster():
    """Head + one worker node; returns the ``Cluster`` (its ``.address`` is the GCS HOST:PORT), with
    ``pinned``: each node's (head first) pinned ports by ``RayParams`` name."""
    ray_env()
    from ray.cluster_utils import Cluster

    head, worker = node_args(head=True) | {"include_dashboard": False}, node_args(head=False)
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(**worker)
    cluster.wait_for_nodes()
    cluster.pinned = [{k: v for k, v in args.items() if k.endswith("_port")} for args in (head, worker)]
    return cluster
