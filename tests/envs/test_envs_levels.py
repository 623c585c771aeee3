"""The sandbox's levels and records (envs/levels.py) and the per-call memory plan (envs/cgroup.py), issue 57:
the names, the record that final.json, the first metrics row and eval keep, the plan without a cgroup (processes
x memory within the budget) and a cgroup v2's files written as the kernel expects them."""

from __future__ import annotations

import os

import pytest
from _sandbox_helpers import CALM, startable_level

from pacs_megatron.envs import cgroup, levels
from pacs_megatron.envs.sandbox import Sandbox, SandboxError, check_sandbox


def test_level_names_and_the_renamed_one():
    levels.check_name("rlimits-trusted", "tools.sandbox", SandboxError)
    with pytest.raises(SandboxError, match="'docker' is not valid"):
        check_sandbox("docker")
    with pytest.raises(SandboxError) as e:
        check_sandbox("rlimits")
    assert "tools.sandbox=rlimits is renamed tools.sandbox=rlimits-trusted" in str(e.value)
    assert "apt-get install bubblewrap" in str(e.value) and "\n" not in str(e.value)


def test_without_a_cgroup_the_budget_is_split_into_processes():
    plan = cgroup.memory_plan(1024, 64, True, "not writable")
    assert plan.cap == "rlimits" and plan.per_call
    # /tmp a quarter, /dev/shm 64 MiB, the rest in processes of at least the floor: never more than the budget
    assert plan.tmp_mb + 64 + plan.processes * plan.process_mb <= 1024 and plan.process_mb >= cgroup.PROCESS_FLOOR_MB
    assert "3 processes x 234 MiB" in plan.describe() and "not writable" in plan.describe()
    assert cgroup.memory_plan(4096, 4, True, "x").processes == 4  # max_processes still bounds it
    assert cgroup.memory_plan(128, 64, True, "x").processes == 1  # at least one, however small
    none = cgroup.memory_plan(1024, 64, False, "not writable")  # no cgroup and no private uid: said, not hidden
    assert not none.per_call and none.processes == 0 and "NOT capped per call" in none.describe()


def test_a_v2_call_group_writes_its_limits(tmp_path):
    """The files a cgroup v2 call writes (a plain folder stands in for cgroupfs: this machine mounts v1)."""
    group = cgroup.Hierarchy(2, (str(tmp_path),)).create(1024, 68)
    try:
        (d,) = group.dirs
        assert open(os.path.join(d, "memory.max")).read() == str(1024 << 20)
        assert open(os.path.join(d, "pids.max")).read() == "68"
        assert not os.path.exists(os.path.join(d, "memory.swap.max"))  # only where the kernel offers it
        assert group.procs_files == [os.path.join(d, "cgroup.procs")] and group.pids() == []
        with open(os.path.join(d, "memory.events"), "w") as f:
            f.write("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
        assert group.oom_kills() == 2
    finally:
        for name in os.listdir(group.dirs[0]):
            os.unlink(os.path.join(group.dirs[0], name))
        group.remove()
    assert not os.path.exists(group.dirs[0])


def test_this_machines_hierarchy_is_found_or_said():
    found = cgroup.find_hierarchy()
    assert isinstance(found, (cgroup.Hierarchy, str)) and found
    if isinstance(found, cgroup.Hierarchy):
        assert all(os.path.isdir(b) and os.path.basename(b) == cgroup.BASE for b in found.bases)


@pytest.mark.subprocess  # the level's probe starts one sandbox
def test_the_record_and_the_first_rows_numbers():
    sb = Sandbox(startable_level(), CALM)
    rec = sb.record()
    assert rec["level"] in ("bwrap", "rlimits-trusted") and rec["cpu_seconds"] == CALM.cpu_seconds
    assert rec["memory_cap"] == sb.memory.cap and rec["not_enforced"] == levels.not_enforced(sb)
    metrics = levels.start_metrics(rec)
    assert metrics["tools/sandbox_level"] == levels.LEVEL_CODES[rec["level"]]
    assert metrics["tools/sandbox_memory_mb"] == (CALM.memory_mb if sb.memory.per_call else -1)
    assert all(isinstance(v, float) for v in metrics.values())  # a metrics row holds numbers
    text = sb.describe()
    assert text.startswith(f"sandbox level: {rec['level']}") and sb.memory.describe() in text


@pytest.mark.parametrize("module", ["levels", "cgroup"])
def test_doctests(module):
    import doctest
    import importlib

    mod = importlib.import_module(f"pacs_megatron.envs.{module}")
    assert doctest.testmod(mod).failed == 0
