"""The names of a run directory and of a checkpoint inside it: the one place they are spelled.

    OUTPUT_DIR/                          RunLayout(OUTPUT_DIR)
      .lock                                .lock          run_dir.py: one run per directory
      metrics.jsonl                        .metrics       one row per step (metrics.py writes it)
      rollouts.jsonl                       .rollouts      a few samples a step (metrics.py writes it too)
      final.json                           .final         the run's summary (run_record.py)
      config.yaml                          .config        the latest launch's resolved config
      configs/launch_NNN.yaml              .configs, .launch_config(n)  every launch's
      eval_sets/NAME.jsonl                 .eval_set(name)  the synthetic task's held-out sets
      hf/                                  .export        where the summary suggests exporting the final model
      launch.json                          .launch        where every rank ran
      tb/                                  .tensorboard
      plots/                               .plots         `pacs-megatron plot`'s default output
      checkpoints/                         .checkpoints
        step_00000050/                     .step_dir(50) -> StepLayout
          COMPLETE                           .marker      written last: a checkpoint without it is partial
          megatron/                          .megatron    megatron's distributed checkpoint -> DistLayout
            metadata.json, common.pt, .metadata  .metadata_json, .common, .index
          extra_state.json                   .extra_state counters, the data loader, the reset step
          hf/                                .hf          the Hugging Face export vLLM reloads
          critic/                            .critic      the PPO critic's own checkpoint
          reference/                         .reference   PACS v2's / the KL term's frozen reference (a DistLayout)

Every module asks these for a path (tests/run/test_layout.py); only ``checkpoint_steps`` and ``has_run`` read disk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{8})$")
"""A checkpoint's directory name (``step_`` and the step, 8 digits, so that names sort as steps do)."""


@dataclass(frozen=True)
class DistLayout:
    """A megatron distributed checkpoint directory (``dist_checkpointing.save``'s output)."""

    path: Path

    @property
    def metadata_json(self) -> Path:
        """megatron's own: the sharded backend and its version."""
        return self.path / "metadata.json"

    @property
    def common(self) -> Path:
        """``torch.save`` of the state every rank shares (scheduler, counters, param groups)."""
        return self.path / "common.pt"

    @property
    def index(self) -> Path:
        """torch.distributed.checkpoint's index of the shard files."""
        return self.path / ".metadata"


@dataclass(frozen=True)
class StepLayout:
    """One checkpoint directory, ``OUTPUT_DIR/checkpoints/step_XXXXXXXX`` (or any directory shaped like one)."""

    path: Path

    @property
    def marker(self) -> Path:
        return self.path / "COMPLETE"

    @property
    def megatron(self) -> DistLayout:
        return DistLayout(self.path / "megatron")

    @property
    def extra_state(self) -> Path:
        return self.path / "extra_state.json"

    @property
    def hf(self) -> Path:
        return self.path / "hf"

    @property
    def critic(self) -> Path:
        return self.path / "critic"

    @property
    def reference(self) -> DistLayout:
        return DistLayout(self.path / "reference")

    @property
    def step(self) -> int | None:
        """The step in the directory's name (None for a directory named otherwise)."""
        m = STEP_DIR.match(self.path.name)
        return int(m.group(1)) if m else None

    def is_complete(self) -> bool:
        return self.marker.is_file()


@dataclass(frozen=True)
class RunLayout:
    """``trainer.output_dir``'s entries.

    Example:
        >>> run = RunLayout(Path("/runs/a"))
        >>> run.metrics, run.step_dir(50).hf
        (PosixPath('/runs/a/metrics.jsonl'), PosixPath('/runs/a/checkpoints/step_00000050/hf'))
    """

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))  # a str is welcome: the field is a Path

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts.jsonl"

    @property
    def final(self) -> Path:
        return self.root / "final.json"

    @property
    def configs(self) -> Path:
        return self.root / "configs"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    def launch_config(self, index: int) -> Path:
        return self.configs / f"launch_{index:03d}.yaml"

    def launch_configs(self) -> list[Path]:
        return sorted(self.configs.glob("launch_*.yaml"))

    def eval_set(self, name: str) -> Path:
        return self.root / "eval_sets" / f"{name}.jsonl"

    @property
    def export(self) -> Path:
        """The Hugging Face model the run's summary suggests ``pacs-megatron export`` writes."""
        return self.root / "hf"

    @property
    def launch(self) -> Path:
        return self.root / "launch.json"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def run_files(self) -> tuple[Path, ...]:
        """Entries whose presence means a run has written here (checkpoints are looked at separately)."""
        return (self.metrics, self.final, self.configs, self.rollouts)

    @property
    def jsonl_logs(self) -> tuple[Path, ...]:
        """The per-step JSONL files (rows with a "step" key), cut back together on a resume."""
        return (self.metrics, self.rollouts)

    def step_dir(self, step: int) -> StepLayout:
        return StepLayout(self.checkpoints / f"step_{step:08d}")

    def staging_dir(self, step: int) -> Path:
        """Where a checkpoint is written before its rename into :meth:`step_dir` (same file system)."""
        return self.checkpoints / f".tmp_step_{step:08d}"

    @property
    def step_example(self) -> Path:
        """A checkpoint's path for a message that names none in particular."""
        return self.checkpoints / "step_XXXXXXXX"

    def staging_dirs(self) -> list[Path]:
        """Checkpoints being written, or left by a failed save."""
        return sorted(self.checkpoints.glob(".tmp_step_*"))

    def corrupt_dir(self, name: str, n: int = 0) -> Path:
        """Where a damaged checkpoint ``name`` (``step_X``) is moved: ``corrupt_step_X`` (``.n`` if taken)."""
        moved = name.replace("step_", "corrupt_step_", 1)
        return self.checkpoints / (f"{moved}.{n}" if n else moved)

    def superseded_dir(self, step: int) -> Path:
        """Where ``--overwrite`` moves a checkpoint newer than the one a resume starts from."""
        return self.checkpoints / f"superseded_step_{step:08d}"

    def moved_aside(self, stamp: str) -> Path:
        """Where ``--overwrite`` moves a whole earlier run: ``OUTPUT_DIR.old-STAMP``, beside it."""
        return self.root.with_name(f"{self.root.name}.old-{stamp}")

    def checkpoint_steps(self) -> list[tuple[int, StepLayout]]:
        """Complete checkpoints (with their marker), oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = [StepLayout(p) for p in self.checkpoints.iterdir() if STEP_DIR.match(p.name)]
        return sorted((s.step, s) for s in found if s.is_complete() and s.step is not None)

    def has_run(self) -> bool:
        """Whether a run has written here (a log or a checkpoints folder)."""
        return self.metrics.is_file() or self.checkpoints.is_dir()
