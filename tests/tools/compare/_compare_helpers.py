"""What the comparison's tests share: the CPU task they compare on and the overrides that make its runs small."""

from __future__ import annotations

from pathlib import Path

GENERALIZE = Path(__file__).resolve().parents[3] / "examples" / "configs" / "cpu_generalize.yaml"
SMALL = [
    "parallel.tp=1",
    "trainer.train_batch_size=4",
    "algorithm.mini_batch_size=4",
    "rollout.n=4",
    "algorithm.micro_batch_size=16",
]
