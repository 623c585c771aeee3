"""A real two-node Slurm cluster on 127.0.0.1 for tests: munged, slurmctld and two slurmd ("n1",
"n2", two CPUs each, so a job can hold 2 tasks per node) from a generated ``slurm.conf`` in a temp dir.

Everything is private to the test: free ports (never Slurm's defaults, other jobs may run Slurm
on this machine), our own munged socket (``AuthInfo=socket=``), state, spool, pid and log files
under the temp dir. The daemons run in the foreground (``-D`` / ``-F``) as our children and are
stopped by PID. Debian's Slurm is built with MULTIPLE_SLURMD, so two slurmd on one host work.
Needs root (slurmd starts jobs as the submitting user) and ``apt-get install slurm-wlm munge``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pacs_megatron.utils.dist import free_ports

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sacct")


def missing_reason() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    missing = [b for b in BINARIES[:-1] if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"Slurm/munge binaries missing ({', '.join(missing)}): apt-get install -y slurm-wlm munge"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd starts jobs as the submitting user)"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key: run `mungekey -c` as the munge user (the Debian package does)"
    return None


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


SLURM_CONF = """\
ClusterName=pacstest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=10
SlurmUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
SchedulerParameters=sched_interval=1
KillWait=30
MinJobAge=600
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={port1} CPUs=2 RealMemory=8000
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={port2} CPUs=2 RealMemory=8000
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """A running cluster; ``env`` points Slurm commands at it (``SLURM_CONF``)."""

    root: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *cmd: str, check: bool = True) -> str:
        out = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=60)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout

    def job_field(self, job: str, key: str) -> str:
        """One field of ``scontrol show job`` (e.g. JobState, ExitCode, Restarts)."""
        for tok in self.run("scontrol", "show", "job", "-o", job).split():
            if tok.startswith(key + "="):
                return tok.split("=", 1)[1]
        raise KeyError(key)

    def wait_job(self, job: str, states: tuple[str, ...], timeout: float) -> str:
        end = time.monotonic() + timeout
        state = "?"
        while time.monotonic() < end:
            state = self.job_field(job, "JobState")
            if state in states:
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job} still {state} after {timeout}s (wanted {states}); logs in {self.root}")

    def cancel_jobs(self, timeout: float = 90.0) -> None:
        """Cancel every job of this cluster and wait until none is left (their ranks get KillWait to
        checkpoint): a job a failed test left running would hold the nodes, so every later test's job
        would wait behind it, and its ranks would outlive the cluster's daemons."""
        jobs = self.run("squeue", "-h", "-o", "%A", check=False).split()
        if jobs:
            self.run("scancel", *jobs, check=False)
        end = time.monotonic() + timeout
        while self.run("squeue", "-h", "-o", "%A", check=False).split() and time.monotonic() < end:
            time.sleep(1)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_cluster(timeout: float = 60.0) -> SlurmCluster:
    """Start munged, slurmctld and slurmd n1, n2; return once both nodes are idle.

    The files live in a fresh ``/tmp/pacs-slurm-*`` directory: the munge user must be able to reach
    its socket there, which pytest's private (0700) tmp_path does not allow.
    """
    root = Path(tempfile.mkdtemp(prefix="pacs-slurm-"))
    os.chmod(root, 0o755)
    munge_dir = root / "munge"
    munge_dir.mkdir()
    shutil.chown(munge_dir, "munge", "munge")
    for d in ("state", "spool"):
        (root / d).mkdir()
    sock = munge_dir / "munge.socket"
    ports = free_ports(3)
    root.joinpath("slurm.conf").write_text(
        SLURM_CONF.format(root=root, munge_socket=sock, ctld_port=ports[0], port1=ports[1], port2=ports[2])
    )
    cluster = SlurmCluster(root)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.STDOUT, "env": cluster.env}
    munged = [_sbin("munged"), "-F", f"--socket={sock}", f"--pid-file={munge_dir}/munged.pid"]
    munged += [f"--log-file={munge_dir}/munged.log", f"--seed-file={munge_dir}/munged.seed"]
    try:
        cluster.procs.append(subprocess.Popen(["runuser", "-u", "munge", "--", *munged], **quiet))
        _wait(lambda: sock.exists(), 10, "munged socket", cluster)
        cluster.procs.append(subprocess.Popen([_sbin("slurmctld"), "-D", "-i", "-f", str(cluster.conf)], **quiet))
        for node in ("n1", "n2"):
            slurmd = [_sbin("slurmd"), "-D", "-N", node, "-f", str(cluster.conf)]
            cluster.procs.append(subprocess.Popen(slurmd, **quiet))

        def idle() -> bool:
            out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            return out.split().count("idle") == 2

        _wait(idle, timeout, "two idle nodes", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait(pred, timeout: float, what: str, cluster: SlurmCluster) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        dead = [p.args for p in cluster.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"daemon exited while waiting for {what}: {dead}\n{cluster.logs()}")
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}\n{cluster.logs()}")
