"""Evaluation: unbiased pass@k / mean@n (``passk``), the library entry the trainer calls
(``runner.evaluate``), the rollout cache key (``cache``) and progress lines (``progress``); the
``pacs-megatron eval`` command is ``tools/eval.py``."""

from pacs_megatron.eval.passk import dataset_metrics, pass_at_k
from pacs_megatron.eval.runner import compute_metrics, evaluate, flatten_metrics, read_rollouts, write_rollouts

__all__ = [
    "compute_metrics",
    "dataset_metrics",
    "evaluate",
    "flatten_metrics",
    "pass_at_k",
    "read_rollouts",
    "write_rollouts",
]
