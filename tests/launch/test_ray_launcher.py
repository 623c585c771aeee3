"""``launcher.kind=ray`` on a real two-node Ray cluster (``ray.cluster_utils.Cluster``, tests/_ray_cluster.py).

- strict_spread puts the two TP ranks of the CPU default on the two nodes (launch.json), and the
  metrics equal those of the same seed's local run bit for bit (timings excepted);
- a rank on the second raylet sees a network variable set in the driver's shell (NCCL_DEBUG) and one
  from ``launcher.env``;
- a rank actor killed mid-run fails the job within seconds with an error naming the rank; a second
  launch resumes from the last checkpoint, and SIGTERM to its driver makes the ranks checkpoint and exit 143;
- bad input: an unreachable ``launcher.ray_address`` and an unsatisfiable placement group each end in
  one error line (no traceback), the latter after ``placement_timeout_s``;
- ``doctor --distributed`` with ``launcher.kind=ray`` runs on the run's ranks, one per raylet: each
  reports its rank, node and hostname resolution, then the timed Gloo all-reduce and the canary.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from _launch_helpers import gone_within
from _runs import CONFIG, NONDETERMINISTIC, metrics_rows, run_watched, train_cmd

from pacs_megatron.utils.dist import free_port

SMALL = [
    "trainer.train_batch_size=10",
    "rollout.n=4",
    "algorithm.micro_batch_size=20",
    "trainer.sft_warmup_steps=2",
    "trainer.test_freq=0",
    "logging.progress_bar=false",
]


def _cmd(out: Path, steps: int, *extra: str) -> list[str]:
    return train_cmd(out, steps, *SMALL, *extra)


def _ray(cluster, *extra: str) -> list[str]:
    return ["launcher.kind=ray", f"launcher.ray_address={cluster.address}", *extra]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")  # the same threads per rank under both launchers


_rows = metrics_rows


def _maths(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NONDETERMINISTIC)}


def _wait_for(pred, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run exited early with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for the run:\n{log.read_text()[-3000:]}")


def _checkpoints(out: Path) -> list[int]:
    return sorted(int(d.name.split("_")[1]) for d in (out / "checkpoints").glob("step_*") if (d / "COMPLETE").is_file())


@pytest.mark.slow
@pytest.mark.distributed
def test_ray_strict_spread_matches_local_run(ray_cluster, tmp_path):
    local, ray_out = tmp_path / "local", tmp_path / "ray"
    assert (run := run_watched(_cmd(local, 3), local, env=_env())).returncode == 0, run.stderr[-3000:]
    proc = run_watched(_cmd(ray_out, 3, *_ray(ray_cluster, "launcher.placement=strict_spread")), ray_out, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 3 |" in proc.stderr + proc.stdout  # rank 0's log reached the driver

    info = json.loads((ray_out / "launch.json").read_text())
    assert info["kind"] == "ray" and info["world_size"] == 2
    assert [r["rank"] for r in info["ranks"]] == [0, 1]
    assert len({r["node_id"] for r in info["ranks"]}) == 2, info  # strict_spread: one TP rank per node
    assert all(r["local_rank"] == 0 and r["local_world_size"] == 1 for r in info["ranks"])
    assert json.loads((local / "launch.json").read_text())["kind"] == "local"

    expected, got = _rows(local), _rows(ray_out)
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for step in expected:
        assert "reward/mean" in got[step] and "pacs/loss" in got[step] and "actor/grad_norm" in got[step]
        assert _maths(got[step]) == _maths(expected[step]), step

    # Corrupt weights are found before Ray starts anything (issue 29: the launcher's preflight reads every
    # weight file's header): one line and exit 2. A rank that dies inside the job is
    # test_killed_rank_actor_fails_fast_then_resumes.
    bad = tmp_path / "bad_model"
    shutil.copytree(local / "model", bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    proc = subprocess.run(
        _cmd(tmp_path / "bad", 1, f"model.path={bad}", "model.init=pretrained", *_ray(ray_cluster)),
        env=_env(),
        timeout=300,
        capture_output=True,
        text=True,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    errors = [line for line in text.splitlines() if " E " in line]
    assert len(errors) == 1 and "model.safetensors is damaged" in errors[0], text[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_ray_separate_engine_on_the_other_node_matches_a_local_run(ray_cluster, tmp_path):
    """rollout.placement=separate under Ray: the trainer rank on one raylet, its engine on the other (strict_spread
    over 1-CPU nodes), weights over gloo between them; k = 1 is deterministic, so the metrics equal the local
    launcher's bit for bit (timings excepted)."""
    sep = ["parallel.tp=1", "rollout.placement=separate", "rollout.max_staleness=1"]
    local, ray_out = tmp_path / "local", tmp_path / "ray"
    assert (run := run_watched(_cmd(local, 3, *sep), local, env=_env())).returncode == 0, run.stderr[-3000:]
    ray_cmd = _cmd(ray_out, 3, *sep, *_ray(ray_cluster, "launcher.placement=strict_spread"))
    proc = run_watched(ray_cmd, ray_out, env=_env())
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    engine_nodes = re.search(r"ray: 1 rollout engine\(s\) on nodes \['(\w+)'\]", text)
    trainer_node = json.loads((ray_out / "launch.json").read_text())["ranks"][0]["node_id"]
    assert engine_nodes and not trainer_node.startswith(engine_nodes.group(1)), text[-3000:]
    expected, got = _rows(local), _rows(ray_out)
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    assert [got[s]["async/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for step in expected:
        assert _maths(got[step]) == _maths(expected[step]), step


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_rank_actor_fails_fast_then_resumes(ray_cluster, tmp_path):
    out, log = tmp_path / "run", tmp_path / "driver.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            _cmd(out, 1000, "trainer.save_freq=2", "launcher.env={PROBE_FROM_CONFIG: from-config}", *_ray(ray_cluster)),
            env=_env() | {"NCCL_DEBUG": "WARN"},  # a network variable in the driver's shell only
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(lambda: bool(_checkpoints(out)), 300, proc, log)
        rank0, rank1 = json.loads((out / "launch.json").read_text())["ranks"]
        assert rank0["node_id"] != rank1["node_id"]  # rank 1 runs on the second raylet
        environ = psutil.Process(rank1["pid"]).environ()
        assert psutil.Process(rank1["pid"]).nice() == 0  # not Ray's worker niceness (15): the rank is the job
        assert environ.get("NCCL_DEBUG") == "WARN" and environ.get("PROBE_FROM_CONFIG") == "from-config", environ
        actor = psutil.Process(rank1["pid"]).parent()  # the Ray worker process that hosts rank 1
        assert "RankActor" in " ".join(actor.cmdline()), actor.cmdline()
        killed_at = time.monotonic()
        actor.kill()
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert elapsed < 20, f"the job took {elapsed:.1f}s to fail"
    error = [line for line in text.splitlines() if "ray launcher:" in line]
    assert len(error) == 1 and "rank 1" in error[0] and "lost" in error[0], text[-3000:]
    assert gone_within(rank1["pid"], 10.0)  # the trainer rank died with its actor (PDEATHSIG)

    last = max(_checkpoints(out))
    stale = max(_rows(out), default=last)
    log2 = tmp_path / "driver2.log"
    with log2.open("w") as f:
        proc = subprocess.Popen(
            _cmd(out, 1000, "trainer.save_freq=0", *_ray(ray_cluster)), env=_env(), stdout=f, stderr=subprocess.STDOUT
        )
    try:
        # The killed run may have logged steps past `last` before it died (this run trims them on
        # resume): only a step past all of those is new work. (1000 steps: never done first.)
        _wait_for(lambda: f"(step {last})" in log2.read_text(), 300, proc, log2)  # "resumed from ... (step N)"
        _wait_for(lambda: max(_rows(out), default=0) > stale, 300, proc, log2)
        proc.send_signal(signal.SIGTERM)  # forwarded to the ranks: checkpoint, then exit 143
        assert proc.wait(timeout=120) == 143, log2.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = _rows(out)
    assert sorted(rows) == list(range(1, max(rows) + 1))
    assert max(_checkpoints(out)) == max(rows) > last


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if "ray launcher:" in line]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.distributed
def test_bad_ray_address_and_unsatisfiable_placement(ray_cluster, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(
        _cmd(tmp_path / "a", 1, "launcher.kind=ray", f"launcher.ray_address={address}"),
        env=_env(),
        timeout=120,
        capture_output=True,
        text=True,
    )
    line = _one_error_line(proc)
    assert address in line and "ray start --head" in line

    started = time.monotonic()
    proc = subprocess.run(
        _cmd(tmp_path / "b", 1, *_ray(ray_cluster, "launcher.gpus_per_rank=1", "launcher.placement_timeout_s=2")),
        env=_env(),
        timeout=120,
        capture_output=True,
        text=True,
    )
    line = _one_error_line(proc)
    assert "asked 2 bundles" in line and "'GPU': 1.0" in line and "2 node(s)" in line, line
    assert time.monotonic() - started < 60
    assert not (tmp_path / "b").exists()  # nothing started


@pytest.mark.distributed
def test_doctor_distributed_under_ray(ray_cluster, tmp_path):
    # --dir relative to the driver's cwd: made absolute there, as the ranks may run elsewhere
    cmd = [sys.executable, "-m", "pacs_megatron", "doctor", "--distributed", "--dir", "shared"]
    cmd += ["--config", str(CONFIG), *_ray(ray_cluster, "launcher.placement=strict_spread")]
    started = time.monotonic()
    proc = subprocess.run(cmd, env=_env(), cwd=tmp_path, timeout=180, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-3000:]
    assert out.startswith("launcher ray, world 2, master "), out  # rank 0's report, whole, on the driver's stdout
    ranks = re.findall(r"^rank (\d)\s+local 0/1  node (\w+)  host (\S+) -> (\S+)  nic \S+ (\S+)", out, re.M)
    assert [r[0] for r in ranks] == ["0", "1"], out
    assert ranks[0][1] != ranks[1][1], out  # strict_spread: two raylets (node ids)
    assert all(re.fullmatch(r"\d+\.\d+\.\d+\.\d+", r[3]) for r in ranks), out  # the hostname resolves
    assert re.search(r"^gloo all-reduce 4 MiB: \d+\.\d+ ms$", out, re.M), out
    assert f"shared {tmp_path / 'shared'}: ok" in out and "ERROR" not in out, out
    sys.stderr.write(f"doctor --distributed on two raylets: {elapsed:.1f}s\n")


@pytest.mark.distributed
def test_cluster_nodes_listen_on_their_pinned_ports(ray_default, ray_cluster):
    """The fixture's ports (tests/_ray_cluster.py) are the ones the nodes registered and listen on:
    distinct, and outside the kernel's ephemeral range, where Ray's port-0 binds land."""
    from _ray_cluster import AGENT_PORTS

    from pacs_megatron.utils.dist import _ephemeral_start

    nodes = [ray_cluster.head_node, *ray_cluster.worker_nodes]
    assert len(nodes) == len(ray_cluster.pinned) == 2
    for node, pinned in zip(nodes, ray_cluster.pinned):
        assert {k: getattr(node, k) for k in AGENT_PORTS} == {k: pinned[k] for k in AGENT_PORTS}  # as in the GCS
        for name in AGENT_PORTS:
            socket.create_connection((node.node_ip_address, pinned[name]), timeout=5).close()  # listening
    head = ray_cluster.pinned[0]
    assert ray_cluster.address.endswith(f":{head['gcs_server_port']}")
    ports = [p for pinned in ray_cluster.pinned for p in pinned.values()]
    assert len(set(ports)) == len(ports) and all(p < _ephemeral_start() for p in ports), ports


def test_rank_order_and_env_pack_tp_groups_on_nodes(monkeypatch):
    """Pure: bundles granted interleaved over two GPU nodes still give consecutive ranks one node."""
    from pacs_megatron.launch.ray_launcher import _rank_order, rank_envs

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    places = [
        {"node_id": n, "ip": ip, "host": n, "gpu_ids": [g], "port": 1000 + i}
        for i, (n, ip, g) in enumerate(
            [("a", "10.0.0.1", "3"), ("b", "10.0.0.2", "0"), ("a", "10.0.0.1", "1"), ("b", "10.0.0.2", "2")]
        )
    ]
    order = _rank_order(places)
    assert order == [0, 2, 1, 3]
    envs = rank_envs(places, order, cpus_per_rank=4, gcs_address="10.0.0.1:6379")
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"} and {e["MASTER_PORT"] for e in envs} == {"1000"}
    assert {e["TORCHELASTIC_USE_AGENT_STORE"] for e in envs} == {"True"}  # rank 0's actor hosts the store
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,1", "3,1", "0,2", "0,2"]  # cuda:LOCAL_RANK is its GPU
    assert [e["PACS_RAY_NODE_ID"] for e in envs] == ["a", "a", "b", "b"]
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"4"} and {e["RAY_ADDRESS"] for e in envs} == {"10.0.0.1:6379"}

    # the driver's network / runtime variables travel, its machine-local paths do not; launcher.env wins
    for k, v in {"NCCL_IB_HCA": "mlx5_0", "GLOO_SOCKET_IFNAME": "ib0", "TORCH_HOME": "/home/me/.torch"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = rank_envs(places, order, 4, "10.0.0.1:6379", extra_env={"NCCL_IB_HCA": "mlx5_1", "X_EXTRA": "1"})[0]
    assert (env["NCCL_IB_HCA"], env["GLOO_SOCKET_IFNAME"], env["X_EXTRA"], env["OMP_NUM_THREADS"]) == (
        "mlx5_1",
        "ib0",
        "1",
        "3",
    )
    assert "TORCH_HOME" not in env


def test_job_actors_ask_for_niceness_0_unless_the_driver_sets_one(monkeypatch):
    from pacs_megatron.utils.proc import ray_job_runtime_env

    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    assert ray_job_runtime_env() == {"env_vars": {"RAY_worker_niceness": "0"}}
    monkeypatch.setenv("RAY_worker_niceness", "5")
    assert ray_job_runtime_env() == {"env_vars": {"RAY_worker_niceness": "5"}}


def test_a_second_signal_stops_the_driver_at_once(monkeypatch):
    """The driver forwards the first SIGTERM to the ranks and returns 143 on a second one (more than
    DUPLICATE_S later) without forwarding it, so launch_ray's ``ray.kill`` ends every actor at once. No
    cluster: a stand-in ``ray`` whose ``wait`` never finishes a rank, and the driver's own handler called
    as a signal would call it."""
    import types

    from pacs_megatron.launch.ray_launcher import _supervise
    from pacs_megatron.utils.preemption import DUPLICATE_S, EXIT_PREEMPTED

    forwarded: list[int] = []
    calls = {"n": 0}

    def wait(refs, num_returns=1, timeout=None):
        calls["n"] += 1
        if calls["n"] in (2, 3):  # a SIGTERM, then another one
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
            time.sleep(DUPLICATE_S + 0.1)
        assert calls["n"] < 8, "the driver kept supervising after the second SIGTERM"
        return [], list(refs)

    fake = types.SimpleNamespace(wait=wait, exceptions=types.SimpleNamespace(RayActorError=RuntimeError))
    monkeypatch.setitem(sys.modules, "ray", fake)
    actor = types.SimpleNamespace(signal=types.SimpleNamespace(remote=forwarded.append))
    before = signal.getsignal(signal.SIGTERM)
    assert _supervise([actor], ["ref0"], [{"node_id": "n0", "host": "h", "ip": "1"}]) == (EXIT_PREEMPTED, "")
    assert forwarded == [signal.SIGTERM]  # the first only
    assert signal.getsignal(signal.SIGTERM) is before  # the driver's handlers are restored
