"""A real two-node Ray cluster on this machine for the launcher and reward-backend tests.

``ray.cluster_utils.Cluster`` starts a head and a worker raylet ("nodes" with distinct node ids) on
one machine: 1 CPU each and a small object store, so ``STRICT_SPREAD`` must use both. Start-up is
about 9 s and 1.4 GB, so the session fixture in ``tests/conftest.py`` starts it once, on first use,
and shuts it down at the end.

Every port a node would take at a fixed default (the dashboard's 8265, its agent's 52365) or draw
in Python (the agents' ports, in older Ray releases) is pinned, from ports ``free_ports``
(pacs_megatron/utils/dist.py) reserves at once per node: other jobs run Ray on the same machine, and
ports drawn one at a time can repeat, which Ray refuses ("Ray component runtime_env_agent is trying
to use a port number ... that is used by other components", ray-project/ray#45484). The raylet's own
ports and the workers' are port 0 (``Cluster`` sets no worker range): bound by the kernel, in its
ephemeral range, where none of the pinned ones lie.
"""

from __future__ import annotations

import os
import sys

import psutil

from pacs_megatron.utils.dist import free_ports

_OBJECT_STORE = 100 * 2**20
AGENT_PORTS = ("runtime_env_agent_port", "metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")
"""Every node's agents: runtime env (HTTP), dashboard agent gRPC (Ray calls it the metrics agent;
``ray start --dashboard-agent-grpc-port``), Prometheus export, dashboard agent HTTP."""
HEAD_PORTS = ("gcs_server_port", "dashboard_port")
HEAD_ONLY = {"include_dashboard": False, "no_monitor": True}
"""No dashboard UI, autoscaler monitor or client server (nothing here uses them): fewer Python processes
start beside the agents, whose start-up Ray allows 15 s (below)."""
STARTS = 3
"""Cluster starts tried. Ray 2.60's raylet aborts when its dashboard agent has not written its port
files 15 s after it started (``WaitForPersistedPort``, a fixed deadline; the agent's imports take
about 1.3 s of CPU). On this 2-core machine at a load average of ~20 (three CPU burners beside other
jobs) that start missed it in two of five runs ("Timed out waiting for file
.../dashboard_agent_listen_port_*" in raylet.err), which Ray reports as "The current node timed out
during startup". Only that start is tried again, after the failed attempt's processes are killed;
nothing a test asserts is retried."""


def node_args(head: bool) -> dict:
    """``Cluster`` arguments of one node: 1 CPU, a small object store, and its ports, pinned."""
    names = AGENT_PORTS + (HEAD_PORTS if head else ())
    ports = dict(zip(names, free_ports(len(names))))
    return {"num_cpus": 1, "object_store_memory": _OBJECT_STORE} | ports | (HEAD_ONLY if head else {})


def ray_env() -> None:
    """What every Ray process of the tests inherits (the raylets, the drivers the tests start)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def start_cluster(*nodes: dict):
    """A ``Cluster`` of ``nodes`` (``node_args``, the head first), with ``pinned``: each node's pinned
    ports by ``RayParams`` name. Ray's node start-up deadline is retried (:data:`STARTS`)."""
    ray_env()
    from ray.cluster_utils import Cluster

    for attempt in range(1, STARTS + 1):
        ours = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            cluster = Cluster(initialize_head=True, head_node_args=nodes[0])
            for args in nodes[1:]:
                cluster.add_node(**args)
            cluster.wait_for_nodes()
            break
        except Exception as e:
            if "timed out during startup" not in str(e):
                raise
            if attempt == STARTS:
                load = os.getloadavg()[0]
                raise RuntimeError(
                    f"Ray could not start a node in {STARTS} tries ({e}) at a load average of {load:.0f} on "
                    f"{os.cpu_count()} cores: its raylet gives the dashboard agent a fixed 15 s (tests/_ray_cluster.py)"
                ) from e
            started = [p for p in psutil.Process().children(recursive=True) if p.pid not in ours]
            for p in started:  # this attempt's Ray processes (by pid), so the next one starts clean
                p.kill()
            psutil.wait_procs(started, timeout=10)
            print(f"Ray cluster start {attempt}/{STARTS} failed ({e}); trying again", file=sys.stderr)
    cluster.pinned = [{k: v for k, v in args.items() if k.endswith("_port")} for args in nodes]
    return cluster


def start_two_node_cluster():
    """Head + one worker node; returns the ``Cluster`` (its ``.address`` is the GCS HOST:PORT)."""
    return start_cluster(node_args(head=True), node_args(head=False))
