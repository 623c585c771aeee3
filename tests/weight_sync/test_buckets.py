"""iter_buckets: size bound, order, dtype casting, duplicates, oversize tensors, streaming."""

from __future__ import annotations

import pytest
import torch

from pacs_megatron.weight_sync import iter_buckets


def _stream(sizes: list[int], dtype=torch.float32):
    return [(f"t{i}", torch.arange(n, dtype=dtype)) for i, n in enumerate(sizes)]


def _nbytes(bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def test_buckets_respect_the_bound_and_keep_order():
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 40, (60,), generator=g).tolist()
    stream = _stream(sizes)
    limit = 100 * 4
    buckets = list(iter_buckets(iter(stream), limit))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in stream]
    assert all(_nbytes(b) <= limit for b in buckets)
    # greedy: a bucket closes only when the next tensor would not fit
    for b, nxt in zip(buckets, buckets[1:]):
        assert _nbytes(b) + _nbytes(nxt[:1]) > limit
    # the tensors are passed through untouched (no copy when no cast is asked for)
    originals = dict(stream)
    assert all(t is originals[n] for b in buckets for n, t in b)


def test_oversize_tensor_travels_alone():
    stream = _stream([3, 50, 2, 2])  # 12, 200, 8, 8 bytes
    buckets = list(iter_buckets(iter(stream), 16))
    assert [[n for n, _ in b] for b in buckets] == [["t0"], ["t1"], ["t2", "t3"]]


def test_dtype_cast_touches_floating_tensors_only():
    stream = [
        ("w", torch.randn(4, 3)),
        ("ids", torch.arange(5)),
        ("mask", torch.tensor([True, False])),
        ("h", torch.randn(2, dtype=torch.bfloat16)),
    ]
    out = {n: t for b in iter_buckets(iter(stream), 1 << 20, torch.bfloat16) for n, t in b}
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], stream[0][1].to(torch.bfloat16))
    assert out["ids"].dtype == torch.int64 and out["ids"] is stream[1][1]
    assert out["mask"].dtype == torch.bool
    assert out["h"] is stream[3][1]  # already the target dtype: not copied
    # sizes are counted after the cast: 12 bf16 values = 24 bytes fit a 24-byte bucket together with nothing else
    sizes = [len(b) for b in iter_buckets(iter([("a", torch.zeros(12)), ("b", torch.zeros(1))]), 24, torch.bfloat16)]
    assert sizes == [1, 1]


def test_duplicate_names_and_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="'t0' twice"):
        list(iter_buckets(iter(_stream([1, 1]) + _stream([1])), 1024))
    with pytest.raises(ValueError, match="bucket_bytes=0 must be > 0"):
        list(iter_buckets(iter(_stream([1])), 0))


def test_streaming_holds_at_most_one_bucket_plus_one_tensor():
    pulled = 0

    def source():
        nonlocal pulled
        for item in _stream([4] * 20):  # 16 bytes each
            pulled += 1
            yield item

    gen = iter_buckets(source(), 48)
    first = next(gen)
    assert len(first) == 3 and pulled == 4  # the 4th tensor was read to learn the bucket was full
    second = next(gen)
    assert len(second) == 3 and pulled == 7
    assert sum(len(b) for b in gen) == 14 and pulled == 20
