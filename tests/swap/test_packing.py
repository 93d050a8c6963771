"""Bucket packing for group_swap: bounded, aligned, ordered, non-overlapping."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from ppswap.backends.host_memory import HOST_ALIGNMENT
from ppswap.swap.transfer import pack_buckets


@dataclass(eq=False)
class _Sized:
    """Stands in for a StorageSpan: packing only reads ``nbytes``."""

    nbytes: int


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=5000), max_size=40),
    bucket_bytes=st.integers(min_value=HOST_ALIGNMENT, max_value=4096),
)
def test_buckets_are_bounded_aligned_ordered_and_disjoint(sizes, bucket_bytes):
    spans = [_Sized(n) for n in sizes]
    buckets = pack_buckets(spans, bucket_bytes)
    placed = [span for bucket in buckets for span, _ in bucket.members]
    assert placed == spans  # every span once, in capture order
    for bucket in buckets:
        assert bucket.members
        assert bucket.nbytes <= bucket_bytes or len(bucket.members) == 1
        end = 0
        for span, offset in bucket.members:
            assert offset % HOST_ALIGNMENT == 0 and offset >= end
            end = offset + span.nbytes
        assert end == bucket.nbytes


def test_a_span_larger_than_a_bucket_gets_its_own():
    buckets = pack_buckets([_Sized(n) for n in (100, 10_000, 100)], 1024)
    assert [[s.nbytes for s, _ in b.members] for b in buckets] == [[100], [10_000], [100]]
