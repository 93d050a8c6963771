"""Several arrays as one message (``ppswap.core.packed``, ``core.wire``): what a tuple of
activations or gradients becomes between processes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ppswap.core.dtypes import BFLOAT16
from ppswap.core.packed import MAX_ELEMENTS, PACKED, is_packed, pack, unpack
from ppswap.core.wire import decode_header, encode_message, wire_array

ELEMENTS: list[Any] = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    None,
    np.array([[1], [0], [1]], dtype=np.int64),
    np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3).astype(BFLOAT16),
    np.array(2.5, dtype=np.float64),
    np.zeros((0, 5), dtype=np.float16),
    np.array([True, False]),
]


def same(got: Any, want: Any) -> bool:
    if want is None:
        return got is None
    return bool(
        got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    )


def test_elements_come_back_bit_exact_with_dtype_shape_and_the_missing_ones() -> None:
    packed = pack(ELEMENTS)
    assert packed.dtype == PACKED and is_packed(packed)
    got = unpack(packed)
    assert len(got) == len(ELEMENTS)
    assert all(same(g, w) for g, w in zip(got, ELEMENTS, strict=True))


def test_unpacked_elements_are_aligned_views_of_the_packed_array() -> None:
    packed = pack(ELEMENTS)
    for element in unpack(packed):
        if element is not None and element.size:
            assert np.shares_memory(element, packed)
            assert element.ctypes.data % 64 == packed.ctypes.data % 64


def test_an_array_received_off_its_alignment_is_copied_aligned() -> None:
    packed = pack(ELEMENTS).view(np.uint8)
    shifted = np.zeros(packed.size + 3, dtype=np.uint8)
    shifted[3:] = packed
    got = unpack(shifted[3:].view(PACKED))
    assert all(same(g, w) for g, w in zip(got, ELEMENTS, strict=True))
    assert all(g.flags.aligned for g in got if g is not None)


def test_a_tuple_crosses_the_wire_as_one_packed_message() -> None:
    body = wire_array(tuple(ELEMENTS), "payload")
    message = encode_message(3, 7, body, inline_max_bytes=1 << 20)
    nbytes, dtype, shape, size, _ = decode_header(message, 3, 7, ("test",))
    assert dtype == PACKED and nbytes == body.nbytes
    received = np.frombuffer(bytes(message[size : size + nbytes]), dtype=dtype).reshape(shape)
    got = unpack(received)
    assert all(same(g, w) for g, w in zip(got, ELEMENTS, strict=True))


@pytest.mark.parametrize(
    ("elements", "error", "words"),
    [
        ((), ValueError, "1 to 64 elements, got 0"),
        ((np.zeros(2),) * (MAX_ELEMENTS + 1), ValueError, "got 65"),
        ((np.zeros(2), [1, 2]), TypeError, "element 1 must be a numpy.ndarray or None, got list"),
        ((np.array([object()]),), TypeError, r"element 0 has dtype dtype\('O'\); allowed"),
    ],
    ids=["empty", "too-many", "not-an-array", "object-dtype"],
)
def test_what_cannot_be_packed_is_named(elements: Any, error: type, words: str) -> None:
    with pytest.raises(error, match=f"payload is a tuple: .*{words}"):
        wire_array(tuple(elements), "payload")


def test_an_array_that_is_not_packed_is_refused() -> None:
    with pytest.raises(ValueError, match="not a packed array"):
        unpack(np.zeros(64, dtype=np.uint8).view(PACKED))
