"""``pacs-megatron`` / ``python -m pacs_megatron``: one subcommand per user task.

Each subcommand lives in its own module, which defines ``add_arguments(parser)`` and
``main(args) -> int``; modules are imported only when their subcommand runs, so ``--help`` is fast
and a GPU-only dependency never breaks an unrelated subcommand.

Every subcommand runs inside one error boundary (launch/errors.py): a bad path, file, model or
setting, raised by the command or by a shared validator (utils/paths.py, launch/model_dir.py,
launch/checks/preflight.py), becomes one line naming it and the fix, and exit code 2. Flags may stand
between ``a.b=c`` overrides (``train --config c.yaml a=1 --resume never b=2``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from pacs_megatron.utils.proc import run_main

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("pacs_megatron.launch.cli", "train with PACS / GRPO / PPO-clip (spawns local ranks unless launched)"),
    "eval": ("pacs_megatron.tools.eval", "sample n answers per problem and report unbiased pass@k"),
    "parity": ("pacs_megatron.tools.parity", "compare Megatron log-probs with Hugging Face transformers"),
    "plot": ("pacs_megatron.tools.plot", "render PNG curves from OUTPUT_DIR/metrics.jsonl"),
    "doctor": ("pacs_megatron.tools.doctor", "report the environment a run would use; --config: layout and GPU memory"),
    "selftest": ("pacs_megatron.tools.selftest", "check this machine: extension, kernel, parity, training, sync"),
    "export": ("pacs_megatron.tools.export", "write a checkpoint as a Hugging Face model (safetensors + tokenizer)"),
    "import-gguf": ("pacs_megatron.tools.import_gguf", "write a GGUF model file as a Hugging Face directory (fp32)"),
    "compare": (
        "pacs_megatron.tools.compare.protocol",
        "PACS vs GRPO vs PPO over seeds with a tuned lr each (JSON + PNG)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pacs-megatron", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def run(name: str, argv: list[str], prog: str | None = None) -> int:
    """Parse ``argv`` for subcommand ``name`` and run it inside the error boundary."""
    from pacs_megatron.launch.errors import run_command

    module = importlib.import_module(COMMANDS[name][0])
    return run_command(name, module, argv, prog or f"pacs-megatron {name}", COMMANDS[name][1])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    return run(argv[0], argv[1:])


def script() -> NoReturn:
    """The ``pacs-megatron`` console script: :func:`main`, then the process's exit (utils/proc.py)."""
    run_main(main)


if __name__ == "__main__":
    script()
