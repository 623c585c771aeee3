"""The one error policy of every command: a user's mistake is one line naming it and the fix, exit 2.

Every command runs inside :func:`boundary` (:func:`run_command`: cli.py's subcommands, the torchrun entry),
so no command needs its own ``try: ... except: log; return 2``. A command (or a validator it calls:
utils/paths.py, launch/model_dir.py, launch/checks/preflight.py) raises; the boundary decides:

- a **user error** (:func:`user_message` returns its line): a bad setting or flag (``ConfigError``), a
  malformed data row (``DataFormatError``), a reward function that cannot be used, a checkpoint that
  cannot be written, or a file-system error that names its file (``[Errno 30] Read-only file system:
  '/x'``) -> that one line, the traceback only at DEBUG, exit 2;
- Ctrl-C -> "interrupted", exit 130 (what a command finished before it is on disk already);
- anything else is a bug -> Python's traceback, as always.

The training ranks have the same classification (launch/rank.py ``run_rank``), with rank 0 speaking
for the job.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from types import ModuleType

from pacs_megatron.utils.logging import get_logger, init_logging

logger = get_logger(__name__)

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message is the whole story (they name the key or file and the fix)."""
    from pacs_megatron.config import ConfigError
    from pacs_megatron.data.records import DataFormatError
    from pacs_megatron.reward import RewardFailureError, RewardFunctionError
    from pacs_megatron.run.checkpoint import CheckpointWriteError

    errors = ConfigError, DataFormatError, RewardFunctionError, RewardFailureError, FileNotFoundError
    return (*errors, CheckpointWriteError)


def user_message(e: BaseException) -> str | None:
    """The one line that reports ``e`` to a user, or None when ``e`` is a bug (show its traceback)."""
    from pacs_megatron.utils.paths import os_error_text

    if isinstance(e, user_errors()):
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, OSError) and e.filename and e.errno:
        return f"{e.filename}: {os_error_text(e)}"
    return None


def _label(e: BaseException) -> str:
    from pacs_megatron.config import ConfigError
    from pacs_megatron.data.records import DataFormatError

    return "config error" if isinstance(e, ConfigError) else "data error" if isinstance(e, DataFormatError) else "error"


def run_command(name: str, module: ModuleType, argv: list[str], prog: str, description: str) -> int:
    """Parse ``argv`` with ``module.add_arguments`` and run ``module.main`` under :func:`boundary`: every
    command's entry (cli.py's subcommands, ``python -m pacs_megatron.launch`` under torchrun / srun)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    module.add_arguments(parser)
    # intermixed: options may stand between the positional overrides (argparse's plain parse stops there)
    return boundary(name, lambda: module.main(parser.parse_intermixed_args(argv)))


def boundary(name: str, fn: Callable[[], int]) -> int:
    """Run command ``name`` (``fn() -> exit code``) under the policy above."""
    try:
        return int(fn() or 0)
    except KeyboardInterrupt:
        init_logging()
        logger.warning("%s: interrupted", name)
        return EXIT_INTERRUPTED
    except Exception as e:
        line = user_message(e)
        if line is None:
            raise
        init_logging()  # idempotent: the command may have failed before it set up logging
        rank = int(os.environ.get("RANK", "0"))
        label = _label(e)
        logger.error("%s: %s: %s", name if rank == 0 else f"{name} (rank {rank})", label, line)
        logger.debug("traceback", exc_info=True)
        return EXIT_USAGE
