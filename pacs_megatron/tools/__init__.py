"""User-facing tools that are not part of the training loop: ``doctor`` (what a run here would use,
and whether a config fits the GPUs) and its memory arithmetic."""
