"""LoRA on the Megatron actor (``actor.lora``, docs/lora.md): a model transform on the built actor.

- ``adapters``: the adapters on megatron's column- and row-parallel linears, merged or switched off;
- ``reference``: the reference policy as the base with the adapters off (PACS v2's reset is a merge);
- ``checkpoint``: adapter-only checkpoints that name their base;
- ``export``: the adapters as a PEFT adapter directory (the adapter-only sync's payload too).

Each name has one import path, its module's (nothing is re-exported here).
"""
