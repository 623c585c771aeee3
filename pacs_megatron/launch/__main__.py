"""``torchrun -m pacs_megatron.launch --config FILE [a.b=c ...]``: one trainer rank per process."""

import argparse
import sys

from pacs_megatron.launch.cli import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pacs_megatron.launch")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
