"""Slurm glue for ``examples/slurm/multinode.sbatch``: srun starts the trainer ranks directly.

srun, not torchrun under srun: with no agent in between, a signal reaches the ranks themselves
(:mod:`pacs_megatron.utils.preemption`), which stop collectively after the step and checkpoint; torchrun's
agent SIGKILLs its workers 30 s after a signal and dies on Slurm's SIGUSR1.

- :func:`apply_srun_env` (in each task) maps ``SLURM_PROCID`` / ``SLURM_STEP_NUM_TASKS`` / ``SLURM_LOCALID`` to
  ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, with ``MASTER_ADDR``/``MASTER_PORT`` from the script or
  ``scontrol``; such a rank exits :data:`EXIT_REQUEUE` (75) after a graceful stop (:func:`srun_exit_code`),
  and the script requeues on rank 0's marker, not on that code.
- ``python -m pacs_megatron.launch.slurm plan --nodes N --nproc-per-node P --config FILE [a.b=c ...]`` prints
  the overrides srun adds (``parallel.dp``, ``trainer.deadline_unix``) or one error line, exit 2.

Details: docs/launch.md, "Slurm" and "Slurm: signals, time limits, requeue".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from datetime import datetime

from pacs_megatron.config import ConfigError, load_config
from pacs_megatron.launch.checks.device import check_device
from pacs_megatron.utils.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED

USAGE = "python -m pacs_megatron.launch.slurm plan --nodes N --nproc-per-node P --config FILE [a.b=c ...]"
# What a rank started by srun returns after it stopped and checkpointed (signal or time budget), for
# the batch script to requeue on. Not 143: srun also reports 143 for a task *killed* by SIGTERM (as
# --kill-on-bad-exit does to the survivors of a crash), and a crash must not be requeued.
# 75 is EX_TEMPFAIL: "temporary failure, try again".
EXIT_REQUEUE = 75
_MAPPED = "PACS_SRUN_RANKS"


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed per-node task counts (``SLURM_STEP_TASKS_PER_NODE``), expanded:
    ``"2(x2),1"`` -> ``[2, 2, 1]``."""
    out: list[int] = []
    for part in filter(None, spec.split(",")):
        count, _, rep = part.partition("(x")
        out += [int(count)] * (int(rep.rstrip(")")) if rep else 1)
    return out


def job_port(job_id: str | int) -> int:
    """A rendezvous port private to the job: 10000-29999, below Linux's ephemeral range (32768-60999),
    where an outgoing connection of some other process could already hold it."""
    return 10000 + int(job_id) % 20000


def head_node_addr(nodelist: str) -> str:
    """The address of the first node of ``nodelist`` (``scontrol show hostnames``, then that node's
    NodeAddr); raises RuntimeError with one line when scontrol cannot say."""
    try:
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()
        node = subprocess.run(
            ["scontrol", "show", "node", "-o", hosts[0]], capture_output=True, text=True, timeout=30
        ).stdout.split()
    except (OSError, IndexError, subprocess.SubprocessError) as e:
        raise RuntimeError(
            f"cannot find the first node of SLURM_JOB_NODELIST={nodelist!r} ({e}): set MASTER_ADDR"
        ) from None
    addr = next((t.split("=", 1)[1] for t in node if t.startswith("NodeAddr=")), "")
    return addr or hosts[0]  # NodeAddr is the hostname itself when the cluster sets none


def apply_srun_env(environ: os._Environ | dict | None = None) -> bool:
    """Inside an srun step of several tasks with no RANK set (no torchrun): derive the torch.distributed
    variables from Slurm's. Returns True when it did. Under torchrun (RANK set) nothing changes.

    ``MASTER_ADDR`` defaults to the first node's address (never 127.0.0.1: in a multi-node step that
    would make every node rendezvous with itself), ``MASTER_PORT`` to :func:`job_port`, and
    ``LOCAL_WORLD_SIZE`` to this node's task count (nodes may hold different counts)."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return False
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS") or 1)  # set by srun only (not in the batch script)
    if ntasks < 2:  # one task: the local spawner starts the ranks, as on a workstation
        return False
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = str(ntasks)
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    counts = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
    node = int(env.get("SLURM_NODEID", "0"))
    env.setdefault("LOCAL_WORLD_SIZE", str(counts[node] if node < len(counts) else 1))
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        env["MASTER_ADDR"] = head_node_addr(nodelist) if nodelist else "127.0.0.1"  # no list: one node
    if "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(job_port(env.get("SLURM_JOB_ID", "0")))
    env[_MAPPED] = "1"
    return True


def srun_exit_code(code: int) -> int:
    """The exit code of a trainer rank: :data:`EXIT_REQUEUE` instead of a graceful stop's 143 (or
    130) when srun started the rank directly, else ``code`` unchanged."""
    if os.environ.get(_MAPPED) == "1" and code in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
        return EXIT_REQUEUE
    return code


def job_end_unix(job_id: str | None = None) -> float:
    """The job's end time (``squeue -o %e``) as Unix seconds; 0.0 when unknown or unlimited."""
    job_id = job_id or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return 0.0
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        return datetime.fromisoformat(out).timestamp()  # squeue prints the controller's local time
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0.0  # "NONE" / "Unknown" (no time limit) or squeue unavailable: no deadline


def plan(nodes: int, nproc_per_node: int, config: str, overrides: list[str]) -> list[str]:
    """The overrides srun adds for this allocation; raises ConfigError with one line when it cannot fit."""
    cfg = load_config(config, overrides)
    check_device(cfg)  # quantized rollouts, routing replay: before the job's ranks start
    par = cfg.parallel
    world = nodes * nproc_per_node
    model = par.tp * par.pp * par.cp  # a replica's ranks: dp is what the allocation leaves
    if world % model:
        raise ConfigError(
            f"{nodes} node(s) x NPROC_PER_NODE={nproc_per_node} = {world} ranks is not a multiple of "
            f"parallel.tp * parallel.pp * parallel.cp = {par.tp}*{par.pp}*{par.cp} = {model}: change the node "
            "count, NPROC_PER_NODE or the layout"
        )
    dp = world // model
    if any(o.startswith("parallel.dp=") for o in overrides) and dp != par.dp:
        raise ConfigError(
            f"parallel.dp={par.dp} was given but {nodes} node(s) x NPROC_PER_NODE={nproc_per_node} = {world} ranks "
            f"give dp={dp}: drop the parallel.dp override (it follows from the allocation)"
        )
    out = [f"parallel.dp={dp}"]
    load_config(config, [*overrides, *out])  # the cross-area checks (batch sizes over dp) for this dp
    if not any(o.startswith("trainer.deadline_unix=") for o in overrides):
        end = job_end_unix()
        if end:
            out.append(f"trainer.deadline_unix={end:.0f}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pacs_megatron.launch.slurm", usage=USAGE)
    p.add_argument("action", choices=["plan"])
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args(argv)
    try:
        sys.stdout.write(" ".join(plan(args.nodes, args.nproc_per_node, args.config, args.overrides)) + "\n")
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
