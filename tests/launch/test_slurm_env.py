"""The environment-level pieces of a cluster launch, through the environment a launcher sets:
Slurm's compressed task counts, the job-id port, the srun -> torch.distributed mapping, which CUDA
device a rank picks under per-task GPU binding, and the stop decision (requeue or not) with the
marker the batch script reads, including a warning that arrives during start-up."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pacs_megatron.config import ConfigError
from pacs_megatron.launch.slurm import apply_srun_env, job_port, tasks_per_node
from pacs_megatron.utils.devices import cuda_ordinal


def test_tasks_per_node_and_job_port():
    assert tasks_per_node("2(x2)") == [2, 2]
    assert tasks_per_node("4(x3),2,1(x2)") == [4, 4, 4, 2, 1, 1]
    assert tasks_per_node("8") == [8] and tasks_per_node("") == []
    ports = {job_port(j) for j in range(0, 200_000, 7)}
    assert min(ports) >= 10000 and max(ports) < 32768  # below Linux's ephemeral range 32768-60999


def test_srun_env_per_node_counts_and_port():
    env = {"SLURM_PROCID": "4", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "5", "SLURM_LOCALID": "0"}
    env |= {"SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_ID": "123456"}
    env |= {"MASTER_ADDR": "10.0.0.1"}
    assert apply_srun_env(env)
    assert (env["RANK"], env["LOCAL_WORLD_SIZE"], env["MASTER_PORT"]) == ("4", "1", str(job_port(123456)))
    assert env["MASTER_ADDR"] == "10.0.0.1"  # given: kept


@pytest.mark.parametrize(
    ("env", "local_rank", "visible", "want"),
    [
        ({"LOCAL_WORLD_SIZE": "8"}, 5, 8, 5),  # every GPU visible to every task: LOCAL_RANK
        ({"LOCAL_WORLD_SIZE": "8", "SLURM_GPUS_PER_TASK": "1"}, 5, 1, 0),  # --gpus-per-task=1
        ({"LOCAL_WORLD_SIZE": "4", "SLURM_GPU_BIND": "map_gpu:0,1,2,3"}, 3, 1, 0),  # --gpu-bind
        ({"LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "2"}, 2, 1, 0),  # bound by the site's prolog
        ({"LOCAL_WORLD_SIZE": "4", "SLURM_GPU_BIND": "none"}, 3, 4, 3),  # explicitly unbound
        ({"LOCAL_WORLD_SIZE": "4", "SLURM_GPUS_PER_TASK": "2"}, 1, 2, "bound to 2 GPUs"),
        ({"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0"}, 1, 1, 0),
        ({"LOCAL_WORLD_SIZE": "2"}, 3, 2, "LOCAL_RANK=3 but this task sees 2 GPU"),  # never ordinal 3
    ],
)
def test_cuda_ordinal_under_gpu_binding(env, local_rank, visible, want):
    if isinstance(want, int):
        assert cuda_ordinal(local_rank, visible, env) == want
    else:
        with pytest.raises(ConfigError, match=want):
            cuda_ordinal(local_rank, visible, env)


_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from pacs_megatron.utils.preemption import PreemptionFlag, install_early_handlers
    marker = sys.argv[1]
    os.environ["PACS_REQUEUE_MARKER"] = marker
    install_early_handlers()
    os.kill(os.getpid(), signal.SIGUSR1)  # the warning arrives while the model would still be loading
    flag = PreemptionFlag()
    out = {"early": [flag.should_stop(), flag.requeue, flag.reason, flag.exit_code]}
    flag.write_requeue_marker(7)
    out["marker"] = json.load(open(marker))
    os.remove(marker)
    flag = PreemptionFlag()
    flag.signum = None
    os.kill(os.getpid(), signal.SIGTERM)  # a user's scancel: stop, checkpoint, no requeue
    out["term"] = [flag.should_stop(), flag.requeue, flag.reason, flag.exit_code]
    flag.write_requeue_marker(8)
    out["term_marker"] = os.path.exists(marker)
    flag = PreemptionFlag()
    os.kill(os.getpid(), signal.SIGUSR1)  # the time-limit warning, then the user's scancel
    os.kill(os.getpid(), signal.SIGTERM)
    out["usr1_then_term"] = [flag.should_stop(), flag.requeue, flag.reason]
    print(json.dumps(out))
    """
)


@pytest.mark.subprocess
def test_stop_decision_and_requeue_marker(tmp_path):
    marker = tmp_path / ".requeue-1"
    res = subprocess.run([sys.executable, "-c", _CHILD, str(marker)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["early"] == [True, True, "SIGUSR1", 143]  # not killed by the early USR1; requeue
    assert out["marker"] == {"step": 7, "reason": "SIGUSR1", "job_id": ""}
    assert out["term"] == [True, False, "SIGTERM", 143] and out["term_marker"] is False
    assert out["usr1_then_term"] == [True, False, "SIGTERM"]  # a cancel wins over the warning
    assert "while starting up" in res.stderr


def test_the_allocation_plan_counts_context_parallel_ranks_in_a_replica(monkeypatch):
    """4 ranks at tp=1, pp=1, cp=2 are 2 data-parallel replicas, not 4: dp leaves out the CP ranks, and an
    allocation that no replica divides is one line naming cp."""
    from pacs_megatron.launch import slurm

    monkeypatch.setattr(slurm, "job_end_unix", lambda: 0.0)
    config = "examples/configs/cpu_tiny.yaml"
    base = [
        "parallel.tp=1",
        "parallel.cp=2",
        "trainer.train_batch_size=8",
        "rollout.n=4",
        "algorithm.micro_batch_size=16",
        "algorithm.mini_batch_size=8",
    ]
    assert slurm.plan(2, 2, config, base) == ["parallel.dp=2"]
    with pytest.raises(ConfigError, match=r"parallel.tp \* parallel.pp \* parallel.cp = 1\*1\*2"):
        slurm.plan(1, 3, config, base)
