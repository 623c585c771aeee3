"""The step's rows, at the bottom of the package: pure torch, importing nothing else of it.

- ``rows``: the row types (:class:`~pacs_megatron.batch.rows.Rollouts`, ``TrainRows``, ``TrainBatch``), their
  padded layout and :func:`~pacs_megatron.batch.rows.check_groups`;
- ``build``: token lists -> padded ``Rollouts``, and the cuts by whole prompt groups (micro-, mini-batches, DP);
- ``packing``: token-budget micro-batches of whole groups, balanced over data-parallel ranks.

Each name has one import path, its module's (nothing is re-exported here).
"""
