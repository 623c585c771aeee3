"""Fixtures of the launch tests: a real two-node Slurm cluster on 127.0.0.1 (slurm_cluster.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # slurm_cluster.py

from slurm_cluster import missing_reason, start_cluster  # noqa: E402


@pytest.fixture(scope="module")
def slurm():
    """munged + slurmctld + slurmd n1, n2 (two CPUs each), stopped by PID at the end of the module."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.cancel_jobs()
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_default():
    """Skips, saying what to install, where ray[default] (the ``ray-jobs`` extra) is missing: without it a Ray
    node starts no dashboard or metrics agent, so nothing listens on their ports. Requested before
    ``ray_cluster`` (same scope, argument order), so a skip starts no cluster."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401 - what Ray imports to start its agents and job server
    except ImportError as e:
        pytest.skip(f"needs ray[default], the ray-jobs extra ({e}): pip install -e '.[ray-jobs]'")
