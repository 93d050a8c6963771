"""A fake CUDA device on CPU tensors, for ``CudaCopyEngine(api=FakeCuda())``.

It implements ``ppswap.backends.torch.cuda_api.CudaApi`` the way the device behaves where
it matters to the engine's correctness, and checks the engine's ordering contract:

- Copies are held back: a non-blocking copy on a copy stream joins that stream's queue
  and runs only when the host synchronizes the stream or an event recorded after it (or
  queries that event), or another stream waits for such an event. Page-locked buffers
  and device allocations start as junk, so a result read before its copy ran is wrong.
- ``violations`` lists each breach of the contract the engine must keep:
  - a D2H copy of a compute-stream tensor on a stream that has not waited, since the
    host last synchronized it, for an event of the compute stream (``wait_event``);
  - a copy that reads or writes a page-locked buffer which a copy still queued also
    reads or writes (a host buffer reused before its copy completed);
  - a copy of a tensor on another device than the stream's.
- ``unrecorded_blocks()``: device blocks allocated on a copy stream that were never
  marked as used by a compute stream (``record_stream``).
- Devices: every tensor is on ``default_device`` unless ``place(tensor, device)`` said
  otherwise (by storage), so a test can pretend several devices.
- ``log``: every call, in order, as tuples (``("wait", stream, event)``, ...).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["FakeCuda", "FakeEvent", "FakeStream"]

_JUNK = 0xA5


@dataclass(eq=False)
class FakeStream:
    name: str
    device: torch.device
    compute: bool
    queue: deque[Any] = field(default_factory=deque)
    waited_compute: bool = False  # waited for a compute event since the host synced it

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


@dataclass(eq=False)
class FakeEvent:
    name: str
    stream: FakeStream | None = None
    done: bool = False

    def __repr__(self) -> str:
        return f"FakeEvent({self.name})"


@dataclass(eq=False)
class _Copy:
    dst: torch.Tensor
    src: torch.Tensor
    pinned: list[tuple[int, int]]  # the byte ranges of page-locked memory it touches


class FakeCuda:
    """``CudaApi`` on CPU tensors (module docstring). Thread-safe."""

    def __init__(self, default_device: str = "cuda:0") -> None:
        self.default_device = torch.device(default_device)
        self.violations: list[str] = []
        self.log: list[tuple[Any, ...]] = []
        self._lock = threading.RLock()
        self._local = threading.local()
        self._names = itertools.count()
        self._compute: dict[torch.device, FakeStream] = {}
        self._places: dict[int, torch.device] = {}
        self._pinned: list[tuple[int, int]] = []  # page-locked buffers: (first, end)
        self._streams: list[FakeStream] = []
        self._blocks: dict[int, bool] = {}  # side-stream block address -> recorded
        self.pinned_bytes = 0

    # -- devices ---------------------------------------------------------------------------
    def place(self, tensor: torch.Tensor, device: str) -> None:
        """Pretend ``tensor``'s storage is on ``device``."""
        self._places[_address(tensor)] = torch.device(device)

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return self._places.get(_address(tensor), self.default_device)

    # -- streams and events ------------------------------------------------------------
    def new_stream(self, device: torch.device) -> FakeStream:
        with self._lock:
            stream = FakeStream(f"copy{next(self._names)}", torch.device(device), compute=False)
            self._streams.append(stream)
            self.log.append(("stream", stream))
            return stream

    def current_stream(self, device: torch.device) -> FakeStream:
        stack: list[FakeStream] = getattr(self._local, "stack", [])
        if stack:
            return stack[-1]
        device = torch.device(device)
        with self._lock:
            stream = self._compute.get(device)
            if stream is None:
                stream = self._compute[device] = FakeStream(
                    f"compute:{device}", device, compute=True
                )
            return stream

    @contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        stack: list[FakeStream] = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    def new_event(self) -> FakeEvent:
        return FakeEvent(f"event{next(self._names)}")

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        with self._lock:
            self.log.append(("record", stream, event))
            event.stream, event.done = stream, False
            if stream.queue:
                stream.queue.append(event)
            else:
                event.done = True  # nothing queued before it (the compute stream's case)

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        with self._lock:
            self.log.append(("wait", stream, event))
            if event.stream is None:
                self.violations.append(f"{stream} waited for {event}, never recorded")
                return
            self._run_until(event)
            if event.stream.compute:
                stream.waited_compute = True

    def synchronize_event(self, event: FakeEvent) -> None:
        with self._lock:
            self.log.append(("sync", event))
            if event.stream is not None:
                self._run_until(event)
                if not event.stream.queue:
                    event.stream.waited_compute = False

    def query(self, event: FakeEvent) -> bool:
        """What ``torch.cuda.Event.query`` answers (and the copies before it run)."""
        with self._lock:
            if event.stream is not None:
                self._run_until(event)
            return event.done

    def synchronize_stream(self, stream: FakeStream) -> None:
        with self._lock:
            self.log.append(("sync", stream))
            while stream.queue:
                self._run_one(stream)
            stream.waited_compute = False

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        with self._lock:
            self.log.append(("record_stream", _address(tensor), stream))
            address = _address(tensor)
            if stream.compute and address in self._blocks:
                self._blocks[address] = True

    def unrecorded_blocks(self) -> int:
        """Blocks allocated on a copy stream never marked used by a compute stream."""
        with self._lock:
            return sum(1 for recorded in self._blocks.values() if not recorded)

    # -- memory ------------------------------------------------------------------------
    def pinned_empty(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        buffer = np.full(nbytes, _JUNK, dtype=np.uint8)
        with self._lock:
            self._pinned.append((buffer.ctypes.data, buffer.ctypes.data + nbytes))
            self.pinned_bytes += nbytes
        return buffer

    def empty(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        strides: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        if strides is None:
            fresh = torch.empty(shape, dtype=dtype)
        else:
            fresh = torch.empty_strided(shape, strides, dtype=dtype)
        fresh.untyped_storage().fill_(_JUNK)
        stream = self.current_stream(device)
        with self._lock:
            self._places[_address(fresh)] = torch.device(device)
            if not stream.compute:
                self._blocks[_address(fresh)] = False
        return fresh

    # -- copies ------------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool) -> None:
        stream = self.current_stream(self.default_device)
        with self._lock:
            dst_host, src_host = self._host_range(dst), self._host_range(src)
            pinned = [r for r in (dst_host, src_host) if r is not None]
            self.log.append(("copy", stream, _address(dst), _address(src)))
            for tensor, host in ((dst, dst_host), (src, src_host)):
                if host is None and self.device_of(tensor) != stream.device:
                    self.violations.append(
                        f"a copy on {stream} ({stream.device}) of a tensor on "
                        f"{self.device_of(tensor)}"
                    )
            if pinned and self._in_flight(pinned):
                self.violations.append(
                    f"a copy on {stream} touches a page-locked buffer a queued copy still uses"
                )
            d2h = dst_host is not None and src_host is None
            if d2h and not stream.compute and not stream.waited_compute:
                self.violations.append(
                    f"a D2H copy on {stream} before it waited for the compute stream"
                )
            if not non_blocking or stream.compute:
                self._run_before(stream)
                dst.copy_(src)
                return
            stream.queue.append(_Copy(dst, src, pinned))

    # -- running what is queued --------------------------------------------------------
    def _host_range(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """The byte range of ``tensor`` if it is page-locked host memory, else None."""
        first = int(tensor.data_ptr())
        for start, end in self._pinned:
            if start <= first < end:
                return first, first + tensor.numel() * tensor.element_size()
        return None

    def _in_flight(self, pinned: list[tuple[int, int]]) -> bool:
        return any(
            isinstance(op, _Copy) and _overlap(op.pinned, pinned)
            for stream in self._streams
            for op in stream.queue
        )

    def _run_until(self, event: FakeEvent) -> None:
        stream = event.stream
        assert stream is not None
        while not event.done and stream.queue:
            self._run_one(stream)
        event.done = True

    def _run_before(self, stream: FakeStream) -> None:
        while stream.queue:
            self._run_one(stream)

    def _run_one(self, stream: FakeStream) -> None:
        op = stream.queue.popleft()
        if isinstance(op, FakeEvent):
            op.done = True
        else:
            op.dst.copy_(op.src)


def _address(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _overlap(some: list[tuple[int, int]], others: list[tuple[int, int]]) -> bool:
    return any(a < d and c < b for a, b in some for c, d in others)


def count(log: list[tuple[Any, ...]], kind: str, where: Callable[[tuple[Any, ...]], bool]) -> int:
    """How many entries of ``kind`` in ``log`` satisfy ``where``."""
    return sum(1 for entry in log if entry[0] == kind and where(entry))
