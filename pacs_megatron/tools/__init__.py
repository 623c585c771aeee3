"""User-facing tools that are not part of the training loop: ``doctor`` (what a run here would use,
and whether a config fits the GPUs, with its memory arithmetic), ``selftest`` (prove a machine:
extension, kernel, parity, training, weight sync) and ``compare`` (PACS vs the baselines over seeds)."""
