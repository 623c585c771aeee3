import sys

from pacs_megatron.cli import main

sys.exit(main())
