"""The model's shape and its formats, without megatron: what the actor, the export and the GGUF import share.

- ``spec``: :class:`~pacs_megatron.hf.spec.ModelSpec`, the architecture facts read once from an HF config;
- ``convert`` (dense) and ``convert_moe`` (Qwen3-MoE experts): HF <-> Megatron names and layouts, bit-exact;
- ``io``: safetensors reading (lazy, sharded) and the streaming writer;
- ``gguf_import``: a GGUF file as a Hugging Face directory (docs/models.md).

Each name has one import path, its module's (nothing is re-exported here).
"""
