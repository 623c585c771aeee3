"""User tools: ``pacs-megatron selftest`` (and the cluster doctor)."""
