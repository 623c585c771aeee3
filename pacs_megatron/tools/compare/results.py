"""A comparison's finished runs kept where they can be committed (``compare --results DIR``).

A protocol of many CPU hours runs across sessions and machines whose run directories do not survive: each
finished run's small record (metrics, rollout samples, summary, config, placement; no checkpoint) is copied
to ``DIR/runs/NAME-KEY/`` as it finishes, and a run found there is copied back before the comparison decides
what to run. The key is the run's (runs.config_key), so only a run of the very same settings is reused;
a restart anywhere loses only the run in progress.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pacs_megatron.run.layout import RunLayout
from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)


def _record(layout: RunLayout) -> list[Path]:
    """The files of a finished run worth keeping: small, and enough to score, plot and audit it."""
    return [layout.metrics, layout.rollouts, layout.final, layout.config, layout.launch]


def _copy(src: RunLayout, dst: RunLayout) -> None:
    """A run's record from one run directory into another (made if missing)."""
    dst.root.mkdir(parents=True, exist_ok=True)
    for a, b in zip(_record(src), _record(dst)):
        if a.is_file():
            shutil.copy2(a, b)


class ResultsDir:
    """``DIR/runs/NAME-KEY/``: the committed record of each finished run of a comparison."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def kept(self, run_dir: Path) -> RunLayout:
        return RunLayout(self.path / "runs" / run_dir.name)

    def restore(self, run_dir: Path) -> bool:
        """Copy a committed finished run into ``run_dir`` (whose own final.json is missing); True if one was."""
        kept = self.kept(run_dir)
        if RunLayout(run_dir).final.is_file() or not kept.final.is_file():
            return False
        _copy(kept, RunLayout(run_dir))
        logger.info("%s: finished run restored from %s", run_dir.name, kept.root)
        return True

    def publish(self, run_dir: Path) -> None:
        """Copy a run that just finished (its final.json written) into this directory."""
        own, kept = RunLayout(run_dir), self.kept(run_dir)
        if not own.final.is_file():
            return
        _copy(own, kept)
        logger.info("%s: kept in %s (commit it)", run_dir.name, kept.root)


def run_cpu(run_dir: Path) -> str | None:
    """The CPU a run ran on (its launch.json, :func:`~pacs_megatron.utils.cpu.cpu_description`), None if unknown."""
    launch = RunLayout(run_dir).launch
    if not launch.is_file():
        return None
    ranks = json.loads(launch.read_text()).get("ranks") or [{}]
    return ranks[0].get("cpu")


def order_blocks(blocks: dict[int, list[Path]], here: str) -> tuple[list[int], dict[int, str]]:
    """Which seeds' blocks (a seed's runs of every method, ``blocks[seed]`` their run dirs) may run on this CPU
    (``here``), begun (or complete) blocks first; and the deferred ones, begun on another CPU and not complete,
    with the CPU they began on. A block runs on one CPU: the same seed samples other tokens on another (other
    kernels), so a block split across CPUs is no pair.

    Example:
        >>> order_blocks({0: [], 1: []}, "x")
        ([0, 1], {})
    """
    begun, fresh, deferred = [], [], {}
    for seed, dirs in sorted(blocks.items()):
        cpus = {c for d in dirs if RunLayout(d).final.is_file() and (c := run_cpu(d))}
        other = sorted(cpus - {here})
        complete = bool(dirs) and all(RunLayout(d).final.is_file() for d in dirs)
        if other and not complete:  # a complete block has nothing left to run, wherever it ran
            deferred[seed] = other[0]
        elif cpus:
            begun.append(seed)
        else:
            fresh.append(seed)
    return begun + fresh, deferred
