"""Launchers: the layer above the trainer that starts ranks and hands each one to
:func:`pacs_megatron.loop.train.train`. The trainer never imports a launcher.

- ``cli``: ``pacs-megatron train`` / ``torchrun -m pacs_megatron.launch``: validate the config, then
  run the trainer in this rank (under a launcher) or start the ranks (``local``).
- ``local``: spawn ``world_size`` ranks on this machine, like ``torchrun --standalone``.
- ``ray_launcher`` (+ ``ray_rank``): ``launcher.kind=ray``, one Ray actor per rank in a placement group.

Slurm and multi-node torchrun are shell scripts in ``examples/`` that call the same entry point.
"""
