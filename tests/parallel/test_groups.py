"""Start-up checks, megatron's groups under TP x PP x DP, the CPU patches, and teardown."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _dist import run_distributed

from pacs_megatron.config import AlgorithmConfig, ConfigError, ParallelConfig, RolloutConfig, RunConfig
from pacs_megatron.parallel import check_layout

MODEL = {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 6}


def test_layout_checks_name_the_field_and_fix():
    check_layout(ParallelConfig(tp=2, pp=3, dp=1), MODEL, world_size=6)
    with pytest.raises(ConfigError, match=r"4 ranks but parallel.tp \* parallel.pp \* parallel.cp \* parallel.dp"):
        check_layout(ParallelConfig(tp=2), MODEL, world_size=4)
    with pytest.raises(ConfigError, match="num_attention_heads=8"):
        check_layout(ParallelConfig(tp=3), MODEL)
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        check_layout(ParallelConfig(tp=4), MODEL)
    with pytest.raises(ConfigError, match="num_hidden_layers=6"):
        check_layout(ParallelConfig(pp=2, vpp=2), MODEL)
    with pytest.raises(ConfigError, match="sequence_parallel=true needs Transformer Engine or NVIDIA Apex"):
        check_layout(ParallelConfig(tp=2, sequence_parallel=True), MODEL)


def test_group_splitting_micro_batches_rejected():
    with pytest.raises(ConfigError, match="a micro-batch holds whole prompt groups"):
        RunConfig(rollout=RolloutConfig(n=4), algorithm=AlgorithmConfig(micro_batch_size=6))
    from pacs_megatron.batch.build import build_rollouts, split_micro_batches

    batch = build_rollouts([[1]] * 8, [[2]] * 8, [0.0] * 8, group_size=4, pad_id=0)
    assert [len(m) for m in split_micro_batches(batch, 4)] == [4, 4]
    with pytest.raises(ValueError, match="would split a prompt group of 4"):
        split_micro_batches(batch, 2)
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size=8"):
        split_micro_batches(batch.rows(0, 4), 8)


def _groups_body(rank, world):
    import torch
    import torch.distributed as dist

    from pacs_megatron.parallel import destroy_parallel, initialize_parallel
    from pacs_megatron.parallel.cpu_patches import apply_cpu_patches

    g = initialize_parallel(ParallelConfig(tp=2, pp=2), {"num_attention_heads": 4, "num_hidden_layers": 4})
    out = {
        "tp": (g.tp_rank, g.tp_size, dist.get_world_size(g.tp_group)),
        "pp": (g.pp_rank, g.pp_size, g.is_first_stage, g.is_last_stage),
        "dp": (g.dp_rank, g.dp_size),
        "pp_last_rank": g.pp_last_rank,
        "device": str(g.device),
        "patched": (apply_cpu_patches(), apply_cpu_patches(), torch.cuda.current_device()),
    }
    x = torch.ones(2)
    out["cuda_noop"] = x.cuda() is x
    destroy_parallel()
    out["destroyed"] = not dist.is_initialized()
    destroy_parallel()  # idempotent
    return out


@pytest.mark.distributed
def test_tp2_pp2_groups():
    results = run_distributed(_groups_body, 4)
    # megatron's default order: TP ranks adjacent, then (DP,) then PP
    assert [r["tp"][:2] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [r["pp"] for r in results] == [(0, 2, True, False)] * 2 + [(1, 2, False, True)] * 2
    assert [r["pp_last_rank"] for r in results] == [2, 3, 2, 3]
    assert all(r["dp"] == (0, 1) and r["device"] == "cpu" for r in results)
    assert all(r["patched"] == (True, True, "cpu") and r["cuda_noop"] and r["destroyed"] for r in results)


@pytest.mark.distributed
def test_single_process_without_launcher():
    code = (
        "from pacs_megatron.config import ParallelConfig\n"
        "from pacs_megatron.parallel import initialize_parallel, destroy_parallel\n"
        "import torch.distributed as dist\n"
        "g = initialize_parallel(ParallelConfig(), {'num_attention_heads': 2, 'num_hidden_layers': 2})\n"
        "assert dist.get_world_size() == 1 and dist.get_backend() == 'gloo' and g.is_last_stage\n"
        "destroy_parallel()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
