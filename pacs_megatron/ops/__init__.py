"""Kernels, Python side: the fused (vocab-parallel) log-prob op and its pure-torch reference.

``fused_logprobs`` picks the C++/CUDA extension (``pacs_megatron._C``) when it is built for the
logits' device, else the reference (with a one-time warning); ``PACS_LOGPROB_IMPL=ext|reference``
or ``impl=`` overrides the choice. ``fused_head_logprobs`` takes the hidden states and the output weight
instead of the logits (the LM head fused in, the logits never materialised). Design: docs/kernel.md.
"""

from pacs_megatron.ops.head import fused_head_logprobs
from pacs_megatron.ops.logprob import ext_available, fused_logprobs
from pacs_megatron.ops.reference import reference_logprobs
from pacs_megatron.ops.types import LogprobOutput

__all__ = ["LogprobOutput", "ext_available", "fused_head_logprobs", "fused_logprobs", "reference_logprobs"]
