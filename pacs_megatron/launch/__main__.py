"""``torchrun -m pacs_megatron.launch --config FILE [a.b=c ...]``: one trainer rank per process."""

from pacs_megatron.utils.early_signals import install_early_handlers

install_early_handlers()  # before torch, megatron and the model load: a pre-emption warning is recorded

import sys  # noqa: E402

from pacs_megatron.cli import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("train", sys.argv[1:], prog="pacs_megatron.launch"))
