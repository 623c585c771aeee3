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
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover
        pass
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def __init__(self, all_ranks: bool) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank()
        return self.all_ranks or record.rank == 0 or record.levelno >= logging.ERROR


def init_logging(level: str = "INFO", all_ranks: bool | None = None) -> logging.Logger:
    """Configure the package logger (idempotent). Errors are shown on every rank."""
    if all_ranks is None:
        all_ranks = os.environ.get("PACS_LOG_ALL_RANKS", "0") == "1"
    root = logging.getLogger(_ROOT)
    root.setLevel(level.upper())
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
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
