"""The torch backend's host side of a span, for every layout and dtype a saved view can have.

``host_bytes`` gives the copy source of a span (the storage bytes its views use), and
``host_views`` rebuilds a view from a copy of those bytes. One C-contiguous view whose bytes
are the whole span goes through numpy (the tensor's own view, ``from_numpy``); every other
case through a ``uint8`` tensor ``set_`` onto the storage. Either way: the source shares
the storage's memory, and the rebuilt view has the original's shape, strides, dtype and
bits, in one storage holding the span.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ppswap.backends.torch import BACKEND as TORCH  # noqa: E402
from ppswap.swap.spans import span_layout  # noqa: E402

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,  # numpy has no such dtype: ml_dtypes' bfloat16 (through int16)
    torch.float64,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]

LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda base: base,
    "0-dim": lambda base: base[1, 2, 3],
    "empty": lambda base: base[:, :0],
    "size-1 dims": lambda base: base[:1, 2:3],
    "transposed": lambda base: base.transpose(0, 2),
    "sliced at an offset": lambda base: base[1:],
    "expanded": lambda base: base[:1].expand(3, 4, 5),
    "flattened": lambda base: base.reshape(-1),
}


def _base(dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(7)) * 4
    if dtype is torch.complex64:
        return torch.complex(values, values.flip(-1))
    return values.to(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as raw integers (bit-exact comparison for every dtype)."""
    if tensor.dtype is torch.bool:
        return tensor.to(torch.uint8)
    if tensor.dtype is torch.complex64:
        return torch.view_as_real(tensor).contiguous().view(torch.int32)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(ints[tensor.element_size()])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_span_read_and_rebuilt_through_the_host_is_the_same_view(
    dtype: torch.dtype, layout: str
) -> None:
    view = LAYOUTS[layout](_base(dtype))
    storage = TORCH.storage_of(view)
    key = TORCH.view_key(view, storage)
    start, nbytes, (offset,) = span_layout(storage.ptr, [key])

    source = TORCH.host_bytes(view, start, nbytes)
    assert source is not None and source.dtype == np.uint8 and source.shape == (nbytes,)
    if nbytes:  # the source is the storage's memory, not a copy of it
        assert source.ctypes.data == storage.ptr + start

    block = source.copy()  # what the offload and the load make of it
    (rebuilt,) = TORCH.host_views(block, [(offset, key)])
    assert rebuilt.dtype == view.dtype
    assert tuple(rebuilt.shape) == tuple(view.shape)
    assert tuple(rebuilt.stride()) == tuple(view.stride())
    assert not rebuilt.is_conj() and not rebuilt.is_neg()
    assert rebuilt.untyped_storage().nbytes() == nbytes
    assert torch.equal(_bits(rebuilt), _bits(view))
    block[:] = 0  # the rebuilt view is the block's memory, not a copy of it
    assert int(torch.count_nonzero(_bits(rebuilt))) == 0


def test_a_lazy_view_is_recognised_and_its_raw_bytes_stay_readable() -> None:
    """numpy() refuses a conjugated or negated view; the swap layer never captures one
    (``is_lazy_view``), and reading its storage's bytes still works."""
    z = _base(torch.complex64)
    for lazy in (z.conj(), z.conj().imag):
        assert TORCH.is_lazy_view(lazy)
        storage = TORCH.storage_of(lazy)
        key = TORCH.view_key(lazy, storage)
        start, nbytes, _ = span_layout(storage.ptr, [key])
        source = TORCH.host_bytes(lazy, start, nbytes)
        assert source is not None and source.ctypes.data == storage.ptr + start
    assert not TORCH.is_lazy_view(z)
