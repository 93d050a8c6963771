"""The CUDA calls of the CUDA copy engine, behind one seam.

:class:`CudaApi` lists every call ``CudaCopyEngine`` makes on the device: streams,
events, ``record_stream``, page-locked host buffers, device allocations and copies.
:class:`TorchCuda` makes them with ``torch.cuda``; a test passes an implementation of
its own that runs on CPU tensors (``tests/torch_backend/fake_cuda.py``: it holds each
copy back until its stream or event is synchronized or waited, and checks the engine's
ordering contract).

Streams and events are opaque handles: only the calls here touch them. Events are
blocking (``torch.cuda.Event(blocking=True)``): a thread that synchronizes one sleeps
until the device signals it instead of spinning a core.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from ppswap.backends.types import HostArray

__all__ = ["CudaApi", "TorchCuda"]


class CudaApi(Protocol):
    """What the CUDA copy engine asks of the device (module docstring). ``stream`` and
    ``event`` arguments are handles this same implementation made."""

    def new_stream(self, device: torch.device) -> Any:
        """A stream of its own on ``device`` (for copies)."""
        ...

    def current_stream(self, device: torch.device) -> Any:
        """The calling thread's current stream on ``device`` (the compute stream on the
        compute thread)."""
        ...

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        """Make ``stream`` the calling thread's current stream inside the block: the
        allocations (``empty``) and copies (``copy``) made there are ordered on it."""
        ...

    def new_event(self) -> Any:
        """A blocking event, not yet recorded."""
        ...

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream``: it completes once the work queued on
        ``stream`` before it has."""
        ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work queued on ``stream`` from now on starts after ``event`` completed (the
        host does not wait)."""
        ...

    def synchronize_event(self, event: Any) -> None:
        """Block the calling thread until ``event`` completed."""
        ...

    def synchronize_stream(self, stream: Any) -> None:
        """Block the calling thread until every copy queued on ``stream`` completed."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``'s memory: it is not
        handed out again before the work queued on ``stream`` until its free is done."""
        ...

    def pinned_empty(self, nbytes: int) -> HostArray:
        """A page-locked ``uint8`` host buffer of ``nbytes`` bytes (uninitialised)."""
        ...

    def empty(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        strides: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Uninitialised device memory, allocated on the calling thread's current stream
        (``strides`` in elements; None: C-contiguous)."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool) -> None:
        """``dst.copy_(src)`` on the calling thread's current stream; ``non_blocking``:
        the host does not wait for it (a host buffer must stay untouched until the copy
        is known complete)."""
        ...

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        """The device ``tensor``'s memory is on."""
        ...


class TorchCuda:
    """:class:`CudaApi` with ``torch.cuda`` (the engine's default)."""

    def __repr__(self) -> str:
        return "TorchCuda()"

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(blocking=True)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def synchronize_event(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def synchronize_stream(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def pinned_empty(self, nbytes: int) -> HostArray:
        buffer: HostArray = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        return buffer

    def empty(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        strides: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        if strides is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty_strided(shape, strides, dtype=dtype, device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool) -> None:
        dst.copy_(src, non_blocking=non_blocking)

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device
