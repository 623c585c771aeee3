from pacs_megatron.cli import main
from pacs_megatron.utils.proc import run_main

run_main(main)
