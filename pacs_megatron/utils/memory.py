"""Host memory of one training step on every rank: ``perf/peak_rss_gb`` and its per-rank parts.

Each rank resets its resident-set high-water mark (``VmHWM``, via ``/proc/self/clear_refs``) when a step
starts and reads it when the step ends, so the peak is the step's own, not the model load's; RSS sees
every page torch touches (large tensors are mmap-ed and returned to the OS when freed). Where the reset
is not available (not Linux), the peak is the process's since its start. On GPU this is host memory
(CPU-side buffers, pinned copies), not the device's.

Metrics (GB = 1e9 bytes), gathered over all ranks (one small all-gather per step):

    perf/peak_rss_gb                 the largest rank's peak
    perf/peak_rss_gb_rank{r}         rank r's peak in the step
    perf/step_rss_gb_rank{r}         rank r's peak minus its RSS when the step started: what the step
                                     itself held in flight (activations, logits, rollout buffers)
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kb(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """This process's resident set size now."""
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """This process's resident high-water mark since its start or the last :func:`reset_peak_rss`."""
    kb = _status_kb("VmHWM")
    return kb * 1024 if kb is not None else rss_bytes()


def reset_peak_rss() -> bool:
    """Set the high-water mark to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class StepMemory:
    """``start()`` when a step begins, ``metrics()`` when it ends (collective over the world)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        reset_peak_rss()
        self.base = rss_bytes()

    def metrics(self) -> dict[str, float]:
        mine = torch.tensor([peak_rss_bytes(), self.base], dtype=torch.float64, device=self.device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        every = torch.empty(world * 2, dtype=torch.float64, device=self.device)  # flat: gloo wants 1-D
        if world > 1:
            dist.all_gather_into_tensor(every, mine)
        else:
            every.copy_(mine)
        every = every.view(world, 2).cpu() / 1e9
        out = {"perf/peak_rss_gb": float(every[:, 0].max())}
        for r, (peak, base) in enumerate(every.tolist()):
            out[f"perf/peak_rss_gb_rank{r}"] = peak
            out[f"perf/step_rss_gb_rank{r}"] = peak - base
        return out
