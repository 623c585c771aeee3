"""``OUTPUT_DIR/launch.json``: where every rank of the job runs, whatever started it.

Each launcher exports ``PACS_LAUNCHER_KIND`` (the local spawner "local", the Ray launcher "ray" with
``PACS_RAY_NODE_ID``; the Slurm / torchrun scripts may set it too). Without it the kind is read from
the variables torchrun (``TORCHELASTIC_RUN_ID``) and srun (``SLURM_PROCID``) export, so the trainer
never imports a launcher. :func:`write_launch_json` gathers every rank's facts (collective) and rank
0 writes the file; users and tests read placement from it::

    {"kind": "ray", "world_size": 2,
     "ranks": [{"rank": 0, "host": "n1", "ip": "10.0.0.1", "local_rank": 0, "local_world_size": 1,
                "pid": 4242, "node_id": "6f1c..."}, ...]}
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from pacs_megatron.run.layout import RunLayout
from pacs_megatron.utils.cpu import cpu_description
from pacs_megatron.utils.dist import all_gather_objects, rank_and_world


def launcher_kind() -> str:
    """Which launcher started this process (see the module docstring)."""
    if os.environ.get("PACS_LAUNCHER_KIND"):
        return os.environ["PACS_LAUNCHER_KIND"]
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    if "SLURM_PROCID" in os.environ:
        return "slurm"
    return "single" if "RANK" not in os.environ else "unknown"


def _ip() -> str:
    """The address other nodes reach this one at (MASTER_ADDR on rank 0), else the loopback."""
    addr = os.environ.get("PACS_NODE_IP")
    if addr:
        return addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def rank_facts() -> dict:
    """This rank's place: host, address, local rank, pid, CPU and (under Ray) node id."""
    rank, _ = rank_and_world()
    facts = {
        "rank": rank,
        "host": socket.gethostname(),
        "ip": _ip(),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "pid": os.getpid(),
        "cpu": cpu_description(),  # numbers differ across CPUs: a run's record names its own
    }
    if os.environ.get("PACS_RAY_NODE_ID"):
        facts["node_id"] = os.environ["PACS_RAY_NODE_ID"]
    return facts


def write_launch_json(output_dir: Path) -> None:
    """Collective: gather :func:`rank_facts` of every rank; rank 0 writes ``output_dir/launch.json``."""
    ranks = all_gather_objects(rank_facts())
    rank, world = rank_and_world()
    if rank == 0:
        info = {"kind": launcher_kind(), "world_size": world, "ranks": ranks}
        RunLayout(Path(output_dir)).launch.write_text(json.dumps(info, indent=2) + "\n")
