"""Group a stream of full Hugging Face-named tensors into size-bounded buckets.

The stream comes from the actor one tensor at a time (gathered over TP, broadcast over PP), so at
most one bucket plus one tensor is alive at once: no full-model copy on the host. A tensor larger
than the bucket travels alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

NamedTensor = tuple[str, torch.Tensor]


def iter_buckets(
    named_tensors: Iterable[NamedTensor], bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[NamedTensor]]:
    """Yield lists of ``(name, tensor)`` whose total size stays within ``bucket_bytes``.

    Floating tensors are cast to ``dtype`` when given (e.g. bfloat16 for a bf16 engine); integer
    buffers are passed through.

    Example:
        >>> ts = [(f"w{i}", torch.zeros(4)) for i in range(3)]  # 16 bytes each
        >>> [[n for n, _ in b] for b in iter_buckets(ts, bucket_bytes=32)]
        [['w0', 'w1'], ['w2']]
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0 (sync.bucket_mb)")
    bucket: list[NamedTensor] = []
    size = 0
    seen: set[str] = set()
    for name, t in named_tensors:
        if name in seen:
            raise ValueError(f"weight stream yielded {name!r} twice")
        seen.add(name)
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
