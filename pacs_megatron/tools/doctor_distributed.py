"""``pacs-megatron doctor --distributed [--dir PATH ...]``, run on every rank of a job:

    srun --nodes 2 --ntasks-per-node 8 pacs-megatron doctor --distributed --dir /shared/runs
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29400 \
        -m pacs_megatron.tools.doctor_distributed --dir /shared/runs
    pacs-megatron doctor --distributed --config RUN.yaml launcher.kind=ray launcher.ray_address=auto

Rank 0 prints one line per rank (host, devices, the interface that reaches ``MASTER_ADDR``, the hostname's
address, ``/dev/shm``, memlock), a timed Gloo all-reduce (and NCCL's, with GPUs), the shared-filesystem canary
of each ``--dir`` (utils/shared_fs.py), then one line per problem; exit 1 on any error, on every rank. Under
Ray the command is the driver and starts the run's rank actors (launch/ray_launcher.py).
What each check catches: docs/launch.md, "On every rank: doctor --distributed".
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist

from pacs_megatron.run.launch_info import launcher_kind
from pacs_megatron.utils.devices import cuda_ordinal
from pacs_megatron.utils.dist import all_gather_objects, under_launcher
from pacs_megatron.utils.shared_fs import unseen_by

SHM_MIN_GIB = 1.0
"""Below this /dev/shm (Docker's default is 64 MiB) NCCL's shared-memory transport fails."""
ALLREDUCE_MIB = 4


def _route_ip(master: str) -> str:
    """The local address the kernel routes to ``master`` from (no packet is sent: UDP connect)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return s.getsockname()[0]
    except OSError:
        return "?"


def _iface_of(ip: str) -> str:
    """The interface holding ``ip`` (``ip -o -4 addr`` is not always installed: /proc is)."""
    if ip.startswith("127."):
        return "lo"
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                req = struct.pack("256s", name.encode()[:15])
                try:
                    addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
                except OSError:
                    continue
                if addr == ip:
                    return name
    except (ImportError, OSError):
        pass
    return "?"


def _memlock() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"


def rank_report() -> dict:
    """What this rank sees, before any collective."""
    host = socket.gethostname()
    try:
        resolved = socket.gethostbyname(host)
    except OSError as e:
        resolved = f"unresolvable ({e})"
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        device = f"cuda:{cuda_ordinal(local_rank, visible)}" if visible else "cpu"
    except Exception as e:  # noqa: BLE001 - ConfigError: reported as this rank's problem
        device = f"ERROR {e}"
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    ip = _route_ip(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    return {
        "rank": dist.get_rank(),
        "local_rank": local_rank,
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "host": host,
        # Slurm's node name; under Ray the node id (two raylets may share a host name)
        "node": os.environ.get("SLURMD_NODENAME") or os.environ.get("PACS_RAY_NODE_ID", "")[:8] or host,
        "resolves_to": resolved,
        "ip": ip,
        "iface": _iface_of(ip),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES", "-"),
        "gpus": visible,
        "device": device,
        "shm_gib": round(shm.f_frsize * shm.f_blocks / 1024**3, 2) if shm else 0.0,
        "memlock": _memlock(),
    }


def _timed_allreduce(device: torch.device, group=None, iters: int = 5) -> float:
    """Milliseconds per all-reduce of ALLREDUCE_MIB MiB (after one warm-up)."""
    t = torch.ones(ALLREDUCE_MIB * 2**18, device=device)
    dist.all_reduce(t, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters * 1e3


def problems(ranks: list[dict], dirs: dict[str, list[str]]) -> list[str]:
    """One line per problem over the gathered reports (each names the fix)."""
    out = []
    hosts = {r["host"] for r in ranks}
    for r in ranks:
        where = f"rank {r['rank']} on {r['node']}"
        if len(hosts) > 1 and r["resolves_to"].startswith("127."):
            out.append(
                f"{where}: hostname {r['host']} resolves to {r['resolves_to']} (loopback; Gloo advertises it and "
                "peers hang): fix /etc/hosts or set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME"
            )
        if r["device"].startswith("ERROR"):
            out.append(f"{where}: {r['device'][6:]}")
        if r["gpus"] and r["shm_gib"] < SHM_MIN_GIB:
            out.append(f"{where}: /dev/shm is {r['shm_gib']} GiB: give the container --shm-size=16g (or --ipc=host)")
        if r["gpus"] and r["memlock"] != "unlimited":
            out.append(f"{where}: memlock limit {r['memlock']}: set `ulimit -l unlimited` (InfiniBand needs it)")
    for path, missing in dirs.items():
        if missing:
            out.append(f"{path} is not on a filesystem every node sees: {', '.join(missing)} cannot read rank 0's file")
    return out


def run(dirs: list[str]) -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mine = rank_report()
    ranks = all_gather_objects(mine)
    gloo_ms = _timed_allreduce(torch.device("cpu"))
    nccl_ms = None
    if torch.cuda.is_available() and not mine["device"].startswith("ERROR"):
        device = torch.device(mine["device"])
        torch.cuda.set_device(device)
        nccl_ms = _timed_allreduce(device, dist.new_group(backend="nccl"))
    shared = {d: unseen_by(d) for d in dirs}
    found = problems(ranks, shared)
    if dist.get_rank() == 0:
        lines = [
            f"launcher {launcher_kind()}, world {dist.get_world_size()}, master "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        ]
        for r in ranks:
            dev = "refused" if r["device"].startswith("ERROR") else r["device"]
            lines.append(
                f"rank {r['rank']:<3} local {r['local_rank']}/{r['local_world_size']}  node {r['node']}  "
                f"host {r['host']} -> {r['resolves_to']}  nic {r['iface']} {r['ip']}  "
                f"devices {r['visible']} ({r['gpus']} GPU) -> {dev}  "
                f"shm {r['shm_gib']} GiB  memlock {r['memlock']}"
            )
        lines.append(f"gloo all-reduce {ALLREDUCE_MIB} MiB: {gloo_ms:.2f} ms")
        lines.append(
            f"nccl all-reduce {ALLREDUCE_MIB} MiB: " + (f"{nccl_ms:.2f} ms" if nccl_ms is not None else "- (no GPU)")
        )
        lines += [f"shared {d}: " + ("ok" if not m else "NOT SHARED") for d, m in shared.items()]
        lines += [f"ERROR {p}" for p in found]
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if found else 0


def _ray_job(args: argparse.Namespace):
    """The run config when it asks for ``launcher.kind=ray`` (this process is then the job's driver), else None."""
    if not (getattr(args, "config", None) or getattr(args, "overrides", None)):
        return None
    from pacs_megatron.config import load_config
    from pacs_megatron.launch.checks.device import check_device

    cfg = load_config(args.config, list(args.overrides))
    check_device(cfg)  # what loading the config checked before these checks left config/
    return cfg if cfg.launcher.kind == "ray" else None


def run_on_ray(cfg, dirs: list[str]) -> int:
    """Drive the check on the Ray cluster of ``cfg.launcher``: one rank actor per rank of the run."""
    from pacs_megatron.launch.ray_launcher import main as ray_main
    from pacs_megatron.launch.ray_rank import RankProgram

    # absolute on the driver: a rank runs in the driver's working directory only where its node has it
    dirs = [os.path.abspath(d) for d in dirs] or [os.path.dirname(os.path.abspath(cfg.trainer.output_dir))]
    args = tuple(a for d in dirs for a in ("--dir", d))
    return ray_main(cfg, RankProgram("pacs_megatron.tools.doctor_distributed", args, capture_stdout=True))


def main(args: argparse.Namespace) -> int:
    from pacs_megatron.config import ConfigError
    from pacs_megatron.launch.slurm import apply_srun_env
    from pacs_megatron.utils.logging import init_logging

    if not under_launcher():
        try:
            cfg = _ray_job(args)
        except ConfigError as e:
            sys.stderr.write(f"error: config: {e}\n")
            return 2
        if cfg is not None:
            init_logging()  # the driver's one-line launch errors
            return run_on_ray(cfg, args.dir)
    try:
        apply_srun_env()  # srun started the tasks: RANK, MASTER_ADDR (scontrol), MASTER_PORT (job id)
    except RuntimeError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    if not under_launcher():
        sys.stderr.write(
            "error: doctor --distributed runs on every rank of a job: start it with srun or torchrun, or give "
            "launcher.kind=ray (and launcher.ray_address) to start the ranks on a Ray cluster "
            "(RANK/WORLD_SIZE are not set)\n"
        )
        return 2
    return run(args.dir or [os.getcwd()])


if __name__ == "__main__":  # torchrun -m pacs_megatron.tools.doctor_distributed
    p = argparse.ArgumentParser(prog="pacs_megatron.tools.doctor_distributed")
    p.add_argument("--dir", action="append", default=[], help="a directory every node must see (repeatable)")
    sys.exit(main(p.parse_args()))
