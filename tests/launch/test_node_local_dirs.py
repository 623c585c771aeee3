"""A truly node-local directory: two torchrun agents ("nodes") on 127.0.0.1, the second in its own
mount namespace (``unshare -m``) with a private tmpfs mounted over ``local/``. What rank 0 writes
there, rank 1 cannot see, as on a cluster whose ``/scratch`` is each node's own disk.

- ``doctor --distributed`` (under torchrun) reports both directories: the shared one ok, the
  node-local one in one line naming the path and the rank that cannot see it; exit 1.
- the trainer with ``trainer.output_dir`` there stops before step 1 (before the model loads) with one
  line naming ``trainer.output_dir``, the path and the node.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _launch_helpers import CONFIG, short_run

from pacs_megatron.utils.dist import free_port

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (mount namespaces)"
    ),
]


def _two_agents(tmp_path: Path, local: Path, *cmd: str, timeout: float = 180) -> tuple[list[int], str]:
    """Node 0 as is, node 1 in a private mount namespace with a tmpfs over ``local``; both run
    ``torchrun ... cmd`` with static node ranks (rank 1 is the one that cannot see ``local``)."""
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    run += ["--master-addr", "127.0.0.1", "--master-port", port]
    procs, logs = [], []
    for node in (0, 1):
        argv = [*run, "--node-rank", str(node), *cmd]
        if node == 1:  # the mount exists only in this agent's namespace (and its ranks')
            quoted = " ".join(f"'{a}'" for a in argv)
            argv = [
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                f"mount -t tmpfs tmpfs '{local}' && exec {quoted}",
            ]
        logs.append((tmp_path / f"node{node}.log").open("w"))
        procs.append(subprocess.Popen(argv, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for fh in logs:
            fh.close()
    return codes, "".join((tmp_path / f"node{n}.log").read_text() for n in (0, 1))


def test_doctor_distributed_finds_a_node_local_dir(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "local"
    local.mkdir()
    args = ["-m", "pacs_megatron.tools.doctor_distributed", "--dir", str(shared), "--dir", str(local / "runs")]
    codes, text = _two_agents(tmp_path, local, *args)
    assert codes[0] == 1, text[-3000:]  # rank 0 found the problem; both ranks exit 1
    assert f"shared {shared}: ok" in text and f"shared {local / 'runs'}: NOT SHARED" in text, text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("ERROR")]
    assert len(errors) == 1 and str(local / "runs") in errors[0] and "(rank 1)" in errors[0], errors
    assert "rank 0   local 0/1" in text and "rank 1   local 0/1" in text  # one line per rank
    assert "gloo all-reduce 4 MiB:" in text and "memlock" in text and "shm" in text
    assert not (local / "runs").exists() or not any((local / "runs").iterdir())  # the canary was removed


def test_trainer_refuses_a_node_local_output_dir_before_step_1(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    out = local / "run"
    train = ["-m", "pacs_megatron.launch", "--config", str(CONFIG), *short_run(out, 3)]
    train += [f"model.path={tmp_path}/model", "parallel.dp=1"]  # the model dir is shared: only output_dir fails
    codes, text = _two_agents(tmp_path, local, *train)
    assert codes[0] != 0 and codes[1] != 0, text[-3000:]
    line = f"trainer.output_dir={out} is not on a filesystem every node sees"
    errs = [ln for ln in text.splitlines() if line in ln]
    assert errs and "(rank 1)" in errs[0], text[-3000:]
    assert "pacs_megatron/" not in text, text[-3000:]  # no traceback of ours (torchrun prints its own)
    assert not (out / "metrics.jsonl").exists()  # stopped before step 1
