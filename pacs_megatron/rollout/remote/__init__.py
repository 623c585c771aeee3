"""Engines on their own ranks (``rollout.placement=separate``; docs/async.md), both sides of the wire.

- ``protocol``: what the trainer and the engine processes say to each other, and how they find each other;
- ``engines``: :class:`~pacs_megatron.rollout.remote.engines.RemoteEngines`, the engines as trainer ranks see them;
- ``server``: the engine side, one process serving the trainer's commands in order.

The engine process's entry is launch/engine_rank.py. Each name has one import path, its module's.
"""
