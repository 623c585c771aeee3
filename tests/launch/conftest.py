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
