"""``torchrun -m pacs_megatron.launch --config FILE [a.b=c ...]``: one trainer rank per process, parsed and run
as ``pacs-megatron train`` is (launch/cli.py, under the error boundary of launch/errors.py)."""

from pacs_megatron.utils.early_signals import install_early_handlers

install_early_handlers()  # before torch, megatron and the model load: a pre-emption warning is recorded

import sys  # noqa: E402

from pacs_megatron.launch import cli  # noqa: E402
from pacs_megatron.launch.errors import run_command  # noqa: E402
from pacs_megatron.utils.proc import run_main  # noqa: E402

if __name__ == "__main__":
    run_main(lambda: run_command("train", cli, sys.argv[1:], "pacs_megatron.launch", "one trainer rank of a PACS run"))
