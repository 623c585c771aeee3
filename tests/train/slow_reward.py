"""A reward for the signal tests: once ``$PACS_SLOW_REWARD_MARKER`` names a file that does not exist yet, the
first call writes it (its process id) and then never returns: native calls of seconds each (tens of GEMMs
in one torch call), back to back, as a generate or a GEMM holds a rank's main thread. Otherwise exact match."""

import os
from pathlib import Path

import torch

MARKER_ENV = "PACS_SLOW_REWARD_MARKER"


def score(prompt: str, response: str, ground_truth: str, extra=None) -> float:
    marker = os.environ.get(MARKER_ENV)
    if marker and not Path(marker).exists():
        Path(marker).write_text(str(os.getpid()))
        while True:  # only a signal ends this step
            torch.linalg.matrix_power(torch.eye(2000), 2**62)  # 62 GEMMs in one call (identity: no overflow)
    return float(response.strip() == ground_truth.strip())
