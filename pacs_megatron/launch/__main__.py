"""``torchrun -m pacs_megatron.launch --config FILE [a.b=c ...]``: one trainer rank per process."""

from pacs_megatron.utils.early_signals import install_early_handlers

install_early_handlers()  # before torch, megatron and the model load: a pre-emption warning is recorded

import argparse  # noqa: E402
import sys  # noqa: E402

from pacs_megatron.launch.cli import add_arguments, main  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pacs_megatron.launch")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
