"""User-facing commands that are not part of the training loop, each a small module calling library
code (``add_arguments(parser)`` and ``main(args)``, wired in ``cli.py``): ``eval`` (pass@k of a model),
``export`` (a checkpoint as a Hugging Face model), ``parity`` (Megatron vs transformers log-probs),
``plot`` (curves from ``metrics.jsonl``), ``doctor`` (what a run here would use, and whether a config
fits the GPUs, with its memory arithmetic), ``selftest`` (prove a machine: extension, kernel, parity,
training, weight sync) and ``compare`` (PACS vs the baselines over seeds). ``train`` is
``launch/cli.py``. Library folders never import this one."""
