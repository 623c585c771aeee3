"""One package logger, configured once; rank 0 speaks unless asked otherwise.

Library code does ``logger = get_logger(__name__)`` and never prints. ``init_logging`` is called
once per process by the entry points (CLI, trainer, test helpers).
"""

from __future__ import annotations

import logging
import os
import sys

_ROOT = "pacs_megatron"
_warned: set[str] = set()


def _rank() -> int:
    # Looked up, not imported: before torch.distributed is imported no process group can exist, and a
    # launcher that never needs torch (the CPU default's parent process) does not import it to log.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def __init__(self, all_ranks: bool) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        record.rank = rank  # the formatter's %(rank)s
        return self.all_ranks or rank == 0 or record.levelno >= logging.ERROR


IMPORT_NOISE = (
    r".*(Apex|Transformer Engine) (is|are) not installed.*",
    r".*cuda_graph_scope.*",
    r".*is not tested with current version of modelopt.*",
)
"""Warnings that megatron-core and modelopt print when imported, saying nothing about the user's run
(Apex / Transformer Engine absent, as always on CPU; modelopt's transformers version notice)."""
DEPRECATION_NOISE = (
    r".*`load_state_dict` is deprecated.*",
    r".*Please use DTensor instead and we are deprecating ShardedTensor.*",
)
"""torch.distributed.checkpoint's FutureWarnings about the APIs megatron-core 0.16 calls (per rank, per load)."""
RANK0_ONLY_MODULES = r"(torch|megatron|transformers|vllm|modelopt|accelerate|ray)(\.|$)"
"""Third-party modules whose Python warnings every rank would print alike (torch's ``all_gather_into_tensor``
deprecation, megatron's ``CUDA_DEVICE_MAX_CONNECTIONS`` advice): rank 0 prints them, the other ranks drop them."""
RANK0_ONLY_MESSAGES = (r".*CUDA_DEVICE_MAX_CONNECTIONS.*",)
"""The same by message, for warnings attributed to the calling frame (``stacklevel``) rather than their module."""


def quiet_import_noise() -> None:
    """Filter :data:`IMPORT_NOISE` and vLLM's "Triton ... CPU backend" notice, so an error or a command's
    own output is not preceded by a screen of them. Process-wide; idempotent."""
    import warnings

    for pattern in IMPORT_NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    for pattern in DEPRECATION_NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)
    triton = logging.getLogger("vllm.triton_utils.importing")  # vLLM keeps existing loggers' filters
    if not any(isinstance(f, _DropMessage) for f in triton.filters):
        triton.addFilter(_DropMessage("doesn't include CPU backend"))


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record, not the one at set-up: a caller that
    redirects stderr (pytest's capture, a notebook) still sees the lines."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def quiet_other_ranks() -> None:
    """On ranks other than 0, drop the third-party warnings that every rank prints alike (:data:`RANK0_ONLY_MODULES`,
    :data:`RANK0_ONLY_MESSAGES`): a 2-rank CPU run printed each of them twice (issue 42). The package's own
    warnings go through the logger, which keeps rank 0's already."""
    import warnings

    if _rank() == 0:
        return
    warnings.filterwarnings("ignore", module=RANK0_ONLY_MODULES)
    for pattern in RANK0_ONLY_MESSAGES:
        warnings.filterwarnings("ignore", message=pattern)


def init_logging(level: str = "INFO", all_ranks: bool | None = None) -> logging.Logger:
    """Configure the package logger (idempotent) and quiet third-party import noise, and third-party warnings on
    ranks other than 0 (unless every rank logs: ``PACS_LOG_ALL_RANKS=1``). Errors are shown on every rank."""
    quiet_import_noise()
    if all_ranks is None:
        all_ranks = os.environ.get("PACS_LOG_ALL_RANKS", "0") == "1"
    if not all_ranks:
        quiet_other_ranks()
    root = logging.getLogger(_ROOT)
    root.setLevel(level.upper())
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s r%(rank)s %(levelname).1s %(name)s] %(message)s", "%H:%M:%S"))
    handler.addFilter(_RankFilter(all_ranks))
    root.addHandler(handler)
    root.propagate = False
    return root


def get_logger(name: str = _ROOT) -> logging.Logger:
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def warn_once(logger: logging.Logger, msg: str) -> None:
    """Log a warning the first time ``msg`` is seen in this process."""
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)
