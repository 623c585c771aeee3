"""User tools beside training (each a ``pacs-megatron`` subcommand): compare."""
