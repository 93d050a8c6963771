"""Storage spans (``ppswap/swap/spans.py``): the byte range of a storage that its saved
views use, where each view lies in it, and how the digests read a view out of it.

The layout is pure arithmetic over ``ViewKey``; the last test is MindSpore's side: its
saved tensors never share a storage, so every span there is one view.
"""

from __future__ import annotations

import itertools
import math
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mindspore import Parameter, Tensor, ops
from swap_support import (
    assert_bit_identical,
    backward,
    forward,
    full_round_trip,
    reference_grads,
    seeded,
)

from ppswap.backends.base import ViewKey
from ppswap.backends.cpu_engine import contiguous_strides
from ppswap.swap import swap_wrapper
from ppswap.swap.spans import (
    SPAN_ALIGNMENT,
    StorageSpan,
    dense_nbytes,
    span_layout,
    view_array,
    view_digest,
)
from ppswap.swap.tensor import SwapTensor, content_digest


def _key(offset: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int = 4):
    return ViewKey(0x1000, offset, shape, strides, f"i{itemsize}", itemsize)


def test_q_k_v_views_at_offsets_make_one_span_of_the_whole_storage() -> None:
    n = 2 * 4 * 4  # elements per head block: q, k, v = qkv.unbind(0) of (3, 2, 4, 4)
    q = _key(0, (2, 4, 4), (16, 4, 1))
    k_t = _key(n, (2, 4, 4), (16, 1, 4))  # k.transpose(1, 2)
    v = _key(2 * n, (2, 4, 4), (16, 4, 1))
    start, nbytes, offsets = span_layout(0x1000, [q, k_t, v])
    assert (start, nbytes) == (0, 3 * n * 4)
    assert offsets == [0, n * 4, 2 * n * 4]


def test_overlapping_views_take_the_union_of_their_bytes_once() -> None:
    x = _key(0, (8, 4, 15), (60, 15, 1))
    flat = _key(0, (32, 15), (15, 1))  # the same bytes, reshaped
    x_t = _key(0, (15, 32), (1, 15))  # the same bytes, transposed
    assert span_layout(0x1000, [x, flat, x_t]) == (0, 8 * 4 * 15 * 4, [0, 0, 0])


def test_a_span_starts_on_the_views_alignment_and_covers_only_used_bytes() -> None:
    # Columns 16..47 of a (4, 64) float32 storage: bytes 64 .. (3 * 64 + 48) * 4.
    cols = _key(16, (4, 32), (64, 1))
    start, nbytes, offsets = span_layout(0x1000, [cols])
    assert start == 64 and nbytes == (3 * 64 + 48) * 4 - 64 and offsets == [0]
    # Column 20 on: the start rounds down to the 64-byte boundary below byte 80.
    start, nbytes, offsets = span_layout(0x1000, [_key(20, (4, 28), (64, 1))])
    assert start == 64 and offsets == [16] and start + nbytes == (3 * 64 + 48) * 4
    # A base off a 64-byte boundary: the alignment kept is the address's (0x1008 + 56).
    start, _, offsets = span_layout(0x1008, [_key(20, (4, 28), (64, 1))])
    assert start == 56 and offsets == [24]
    # No boundary between the base and the first used byte: the span starts there.
    start, _, offsets = span_layout(0x1008, [_key(4, (4, 28), (64, 1))])
    assert start == 16 and offsets == [0]


def test_views_of_different_element_sizes_start_on_their_own_boundaries() -> None:
    halves = ViewKey(0x1000, 3, (5,), (1,), "f2", 2)  # bytes 6..16
    words = ViewKey(0x1000, 3, (2,), (1,), "f8", 8)  # bytes 24..40
    start, nbytes, offsets = span_layout(0x1000 + 8, [halves, words])
    assert start % 8 == 0 and start <= 6 and start + nbytes == 40
    assert offsets == [6 - start, 24 - start]


def test_a_view_without_elements_does_not_widen_the_span() -> None:
    empty = _key(500, (0, 3), (3, 1))
    used = _key(4, (3,), (1,))
    assert span_layout(0x1000, [empty, used]) == (0, 28, [0, 16])
    assert span_layout(0x1000, [empty]) == (0, 0, [0])


@settings(max_examples=60, deadline=None)
@given(
    offset=st.integers(0, 40),
    shape=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    order=st.integers(0, 5),
    base=st.sampled_from([0, 8, 64]),
)
def test_a_view_read_out_of_its_span_has_the_original_elements(offset, shape, order, base):
    """Any (transposed) view of a storage, cut to its span and read back with view_array,
    digests like the view itself (the per-view checks see the same bytes), also where
    the digest reads a dense view's bytes in place."""
    storage = np.arange(12**3 + 40, dtype=np.float32)  # room for every view drawn
    axes = list(itertools.permutations(range(len(shape))))[order % math.factorial(len(shape))]
    contiguous = contiguous_strides(tuple(shape))
    shape_t = tuple(shape[i] for i in axes)
    strides_t = tuple(contiguous[i] for i in axes)
    key = ViewKey(0x1000 + base, offset, shape_t, strides_t, "float32", 4)
    view = np.lib.stride_tricks.as_strided(
        storage[offset:], shape_t, tuple(4 * s for s in strides_t)
    )
    start, nbytes, (place,) = span_layout(key.storage_ptr, [key])
    assert (key.storage_ptr + start) % SPAN_ALIGNMENT == 0 or base
    span = storage.view(np.uint8)[start : start + nbytes].copy()
    got = view_array(span, place, key)
    assert got.tobytes() == np.ascontiguousarray(view).tobytes()
    for mode in ("sampled", "full"):
        assert content_digest(got, mode) == content_digest(view, mode)
        assert content_digest(np.ascontiguousarray(view), mode) == content_digest(view, mode)
        assert view_digest(span, place, key, mode, dense_nbytes(key)) == content_digest(view, mode)


class _NoOwner:
    def materialize(self, entry: SwapTensor) -> object:
        raise AssertionError("not unpacked here")


@settings(max_examples=80, deadline=None)
@given(
    offset=st.integers(0, 40),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    order=st.integers(0, 5),
    odd_unit_stride=st.integers(-3, 7),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    base=st.sampled_from([0, 2, 8, 24, 64]),
)
def test_the_span_of_one_view_is_laid_out_as_span_layout_does(
    offset, shape, order, odd_unit_stride, itemsize, base
):
    """``StorageSpan.of`` lays one C-contiguous view out inline: the same start, size and
    offset as ``span_layout`` for every single view (transposed, with size-1 dimensions
    of any stride, without elements, of any element size)."""
    axes = list(itertools.permutations(range(len(shape))))[order % math.factorial(len(shape))]
    contiguous = contiguous_strides(tuple(shape))
    shape_t = tuple(shape[i] for i in axes)
    strides_t = tuple(
        odd_unit_stride if shape[i] == 1 else contiguous[i] for i in axes
    )  # a dimension of size 1 may carry any stride (torch keeps what the op left)
    ptr = 0x1000 + base
    key = ViewKey(ptr, offset, shape_t, strides_t, f"u{itemsize}", itemsize)
    owner = _NoOwner()
    fingerprint, block = (ptr, 0, None), ("storage", ptr)
    entry = SwapTensor(weakref.ref(owner), "g", "t0", key, False, (0, 0), None, fingerprint, block)
    span = StorageSpan.of(ptr, [entry])
    start, nbytes, offsets = span_layout(ptr, [key])
    assert (span.start, span.nbytes, span.offsets) == (start, nbytes, tuple(offsets))
    assert span.dense == (dense_nbytes(key),) and entry.span is span


@pytest.mark.parametrize("group_swap", [False, True])
def test_mindspore_saved_views_each_have_a_storage_so_a_span_is_one_view(
    make_session, copy_thread, group_swap
) -> None:
    """MindSpore copies a view before autograd saves it: transposes, slices and unbound
    rows arrive as contiguous tensors of their own, and every span is one of them."""
    w = Parameter(seeded((12, 12), 5, 0.3), name="w")
    x = seeded((3, 12), 6)

    def block(inp: Tensor) -> Tensor:
        y = ops.tanh(ops.matmul(inp, w))
        a, b, c = ops.unbind(y, 0)
        return ops.matmul(y.transpose(1, 0), y).sum() + (a * b * c).sum() + (y[:, 2:5] ** 2).sum()

    expected = reference_grads(block, x, [w])
    session = make_session()
    with session.collection_context(0, 0, protected=[x], parameters=[w]):
        _, vjp_fn = forward(swap_wrapper(block, group_swap=group_swap), x, [w])
    group = session.manager.get_group(session.group_name(0, 0))
    spans = group.spans()
    assert len(spans) >= 4
    for span in spans:
        ((entry, offset),) = span.members
        assert offset == 0 and entry.key.offset == 0 and span.nbytes == entry.nbytes
    assert len({span.storage_ptr for span in spans}) == len(spans)
    _, restored = full_round_trip(session, 0, 0, copy_thread)
    assert restored == sum(span.nbytes for span in spans) == session.stats().offloaded_bytes
    assert_bit_identical(expected, backward(vjp_fn))
    session.release_chunk(0, 0)
