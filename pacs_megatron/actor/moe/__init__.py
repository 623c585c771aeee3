"""The actor's MoE parts (Qwen3-MoE; docs/models.md): what the routers did, and what they are told to do.

- ``routing``: the routers of a model chunk, per-step router statistics and routing replay (R3);
- ``aux_loss``: the load-balancing loss, scaled so that its gradient does not depend on the RL loss.

Each name has one import path, its module's (nothing is re-exported here).
"""
