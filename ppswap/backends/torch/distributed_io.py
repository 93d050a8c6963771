"""One message over torch.distributed: the header, the body, and how they are matched.

A message is ``ppswap.core.wire``'s format on a gloo group: the header on tag ``t``, with
the payload inside it up to ``inline_max_bytes`` (``DEFAULT_INLINE_MAX_BYTES``, 1 MiB),
a larger payload's raw bytes on tag ``t + 1``. gloo lets a receive buffer be larger than
the message, so every header lands in a (reused) buffer of the largest header size plus
the inline limit; once it is in, the waiting thread decodes it and posts the body's
receive itself (one wake-up of the event loop per message).

Why 1 MiB, where ``MPITransport`` inlines up to 16 KiB: every gloo message costs the
receiver a wake-up of a waiting thread and the sender a rendezvous; up to about that size
that costs more than copying the payload into the header message and out of it (once on
each side; a body travels without a copy). ``docs/torch_dist.md`` has the measurement.

With NCCL bodies (``device`` set): NCCL ignores tags and matches a pair's operations in
posting order, and a pair's sends and receives share one CUDA stream per group. So bodies
go over two NCCL groups, one per direction (``groups[1]`` from lower to higher ranks,
``groups[2]`` back), and the receiver, holding a lock per peer, posts the body's receive
and then sends "go" (gloo, tag ``t + 1``); the sender posts the body only after "go". At
most one body per direction is in flight, and no receive waits behind a send. Untested on
this project's machines (no GPU).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from ppswap.backends.torch.distributed_wait import (
    Done,
    Posted,
    Then,
    Waiters,
    WorkError,
    host_tensor,
)
from ppswap.core.transport import FINISHED, Started
from ppswap.core.wire import (
    HEADER_MAX_BYTES,
    RecvBufferPool,
    decode_header,
    describe,
    encode_message,
)

__all__ = ["DEFAULT_INLINE_MAX_BYTES", "MessageIO"]

Array = npt.NDArray[Any]
Header = tuple[int, np.dtype[Any], tuple[int, ...], int, int]

DEFAULT_INLINE_MAX_BYTES = 1 << 20


class MessageIO:
    """Sends and receives whole messages of one rank over ``groups`` (gloo first, then the
    two NCCL groups when ``device`` is a CUDA device), on the event loop's thread.

    ``what`` names a message in errors. A failed operation raises ``RuntimeError`` naming
    the message and sets ``peer_failed``. ``inline_max_bytes``: payloads up to this size
    travel inside the header message (every rank must use the same).
    """

    def __init__(
        self,
        groups: list[dist.ProcessGroup],
        device: torch.device | None,
        recv_pool_bytes: int,
        inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES,
    ) -> None:
        self.waiters = Waiters()
        self.peer_failed = False
        self._groups = groups
        self._device = device
        self._rank = dist.get_rank()
        self._recv_pool = RecvBufferPool(recv_pool_bytes)
        self._pool_lock = threading.Lock()  # the waiting threads take buffers too
        self._inline_max_bytes = inline_max_bytes
        self._first_bytes = HEADER_MAX_BYTES + inline_max_bytes  # a header, payload inline
        self._header_buffers: list[bytearray] = []  # free receive buffers of _first_bytes
        self._body_locks: dict[int, anyio.Lock] = {}  # NCCL: one body per peer at a time
        self._failed_send: str | None = None  # a send nobody awaited failed (see send)

    def start_send(
        self,
        dst: int,
        tag: int,
        header: tuple[int, int],
        body: Array,
        what: tuple[object, ...],
        on_done: Done,
        p2p_send: bool = True,
    ) -> Started:
        """``send`` without a task (gloo only): ``on_done`` gets ``None`` or the error, on
        the loop, once ``body`` may be reused (at once for a payload inside the header)."""
        works = self._post_header(dst, tag, header, body, what, p2p_send)
        if works is None:
            on_done(None)
            return FINISHED
        works.append((self._post(dist.isend, host_tensor(body), dst, tag + 1), False))
        done = partial(self._ended, what, on_done)
        return self.waiters.submit(works, None, p2p_send, done, body)

    async def send(
        self,
        dst: int,
        tag: int,
        header: tuple[int, int],
        body: Array,
        what: tuple[object, ...],
        p2p_send: bool = True,
    ) -> None:
        """Send ``body`` (from ``wire_array``) to ``dst`` under ``(epoch, identity)``.

        Returns once ``body`` may be reused: at once for a payload inside the header (it
        was copied there; the send completes in the background, and if it fails, the next
        call raises that), else when the receiver has taken it.
        """
        works = self._post_header(dst, tag, header, body, what, p2p_send)
        if works is None:
            return
        if self._device is None:
            works.append((self._post(dist.isend, host_tensor(body), dst, tag + 1), False))
            await self._complete(works, what, p2p_send=p2p_send)
            return
        go = torch.zeros(1, dtype=torch.uint8)  # NCCL: the body goes after the receiver's "go"
        works.append((self._post(dist.irecv, go, dst, tag + 1), False))
        await self._complete(works, what, p2p_send=p2p_send)
        stage = host_tensor(body).to(self._device)
        work = self._post(dist.isend, stage, dst, 0, 1 if self._rank < dst else 2)
        await self._complete([(work, True)], what)

    def _post_header(
        self,
        dst: int,
        tag: int,
        header: tuple[int, int],
        body: Array,
        what: tuple[object, ...],
        p2p_send: bool,
    ) -> Posted | None:
        """Post the header message: its work, or None for a payload inside it (then the
        send is waited for in the background, and a failure fails the next call)."""
        self._check_failed_send()
        message = encode_message(*header, body, inline_max_bytes=self._inline_max_bytes)
        header_tensor = torch.frombuffer(message, dtype=torch.uint8)  # writable: no warning
        works: Posted = [(self._post(dist.isend, header_tensor, dst, tag), False)]
        if body.nbytes <= self._inline_max_bytes:
            self.waiters.start(works, p2p_send, lambda error: self._send_failed(error, what))
            return None
        return works

    def start_recv(
        self,
        src: int,
        tag: int,
        header: tuple[int, int],
        what: tuple[object, ...],
        on_done: Callable[[Array | None, BaseException | None], None],
        on_landed: Callable[[Array], object] | None = None,
    ) -> Started:
        """``recv`` without a task (gloo only): ``on_done`` gets ``(array, None)`` or
        ``(None, error)`` on the loop. The array is made on the waiting thread, which
        hands it to ``on_landed`` first (``LandingTransport``)."""
        first, works, post_body, found, bodies = self._post_recv(src, tag, header, what)
        arrived: list[Array] = []

        def landed() -> None:  # on the waiting thread, once the payload is in
            arrived.append(array := self._landed(first, found[0], bodies))
            if on_landed is not None:
                on_landed(array)

        def ended(error: BaseException | None) -> None:
            if error is not None:
                on_done(None, self._failure(error, what))
                return
            on_done(arrived[0], None)

        return self.waiters.submit(works, post_body, False, ended, first, landed)

    async def recv(
        self, src: int, tag: int, header: tuple[int, int], what: tuple[object, ...]
    ) -> Array:
        """The message from ``src`` on ``tag``, checked against ``(epoch, identity)``."""
        first, works, post_body, found, bodies = self._post_recv(src, tag, header, what)
        await self._complete(works, what, then=post_body)
        if self._device is None or found[0][0] <= self._inline_max_bytes:
            return self._landed(first, found[0], bodies)
        nbytes, dtype, shape, _, _ = found[0]
        self._header_buffers.append(first)
        with self._pool_lock:
            raw = self._recv_pool.take(nbytes)
        async with self._body_locks.setdefault(src, anyio.Lock()):
            # NCCL: post the body's receive, then say "go" (module doc)
            stage = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            data = self._post(dist.irecv, stage, src, 0, 2 if src > self._rank else 1)
            go = self._post(dist.isend, torch.zeros(1, dtype=torch.uint8), src, tag + 1)

            def land() -> None:  # on the waiting thread, once the body is in
                torch.from_numpy(raw).copy_(stage)

            await self._complete([(go, False), (data, True)], what, then=land)
        return np.ndarray(shape, dtype, raw)

    def _post_recv(
        self, src: int, tag: int, header: tuple[int, int], what: tuple[object, ...]
    ) -> tuple[bytearray, Posted, Then, list[Header], list[Array]]:
        """Post the header's receive. Returns its buffer, its work, the continuation that
        decodes the header on the waiting thread and posts a gloo body's receive, and the
        lists that continuation fills (the header's fields, the body's buffer)."""
        self._check_failed_send()
        buffers = self._header_buffers
        first = buffers.pop() if buffers else bytearray(self._first_bytes)
        posted = self._post(dist.irecv, torch.frombuffer(first, dtype=torch.uint8), src, tag)
        found: list[Header] = []
        bodies: list[Array] = []

        def post_body() -> Posted | None:  # on the waiting thread, once the header is in
            found.append(decode_header(first, *header, what))
            nbytes = found[0][0]
            if nbytes <= self._inline_max_bytes or self._device is not None:
                return None
            with self._pool_lock:
                bodies.append(raw := self._recv_pool.take(nbytes))
            return [(self._post(dist.irecv, torch.from_numpy(raw), src, tag + 1), False)]

        return first, [(posted, False)], post_body, found, bodies

    def _landed(self, first: bytearray, found: Header, bodies: list[Array]) -> Array:
        """The array of a received message whose payload is inline or in ``bodies``; the
        header buffer goes back for reuse (any thread: only the loop takes buffers out,
        so appending here races with nothing)."""
        nbytes, dtype, shape, size, _ = found
        if nbytes <= self._inline_max_bytes:
            inline = first[size : size + nbytes]  # a copy
            self._header_buffers.append(first)
            return np.ndarray(shape, dtype, np.frombuffer(inline, dtype=np.uint8))
        self._header_buffers.append(first)
        return np.ndarray(shape, dtype, bodies[0])

    def clear(self) -> None:
        """Forget the receive buffers kept for reuse."""
        self._recv_pool.clear()
        self._header_buffers.clear()

    def _send_failed(self, error: BaseException, what: tuple[object, ...]) -> None:
        self.peer_failed = self.peer_failed or isinstance(error, WorkError)
        self._failed_send = f"{describe(what)}: {error}"

    def _check_failed_send(self) -> None:
        if self._failed_send is not None:
            raise RuntimeError(f"an earlier send failed: {self._failed_send}")

    def _post(
        self, op: Any, tensor: torch.Tensor, peer: int, tag: int, group: int = 0
    ) -> dist.Work:
        """``op`` (``dist.isend`` / ``dist.irecv``) on ``groups[group]``: its Work.

        Posted with the process group's own ``send`` / ``recv``: ``dist.isend`` and
        ``dist.irecv`` only add argument checks and the translation of ``peer`` into a
        rank of the group, the identity on these groups of every rank (a third of a
        message's posting time on the event loop, measured).
        """
        process_group = self._groups[group]
        if op is dist.isend:
            return process_group.send([tensor], peer, tag)
        return process_group.recv([tensor], peer, tag)

    async def _complete(
        self,
        works: Posted,
        what: tuple[object, ...],
        then: Then | None = None,
        p2p_send: bool = False,
    ) -> None:
        try:
            await self.waiters.complete(works, then, p2p_send)
        except WorkError as error:
            raise self._failure(error, what) from error

    def _failure(self, error: BaseException, what: tuple[object, ...]) -> BaseException:
        """A failed operation's error as raised: a ``WorkError`` as a ``RuntimeError``
        naming the message (and ``peer_failed`` set), anything else as itself."""
        if not isinstance(error, WorkError):
            return error
        self.peer_failed = True
        failure = RuntimeError(f"{describe(what)}: {error}")
        failure.__cause__ = error
        return failure

    def _ended(self, what: tuple[object, ...], on_done: Done, error: BaseException | None) -> None:
        on_done(None if error is None else self._failure(error, what))
