"""pacs_megatron: PACS (arXiv 2509.02522) RLVR post-training on Megatron-Core.

One step, one folder each::

    data/ -> rollout/ -> reward/ -> actor/ (old log-probs) -> pacs/ (loss) -> actor/ (step) -> weight_sync/

``pacs/`` is pure torch; only ``parallel/`` and ``actor/`` import megatron, only ``rollout/`` and
``weight_sync/`` import vllm.
"""

__version__ = "0.1.0"
