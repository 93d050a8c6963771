"""``MPITransport``: the P2P ``Transport`` (and FSDP's collectives) over mpi4py.

One process per rank, launched with ``mpiexec -n N``; ``docs/mpi.md`` has the recipe, the
design notes and the measured overhead. In short:

- Non-blocking, no thread: calls post ``Isend`` / ``Irecv`` and poll ``Test()`` from the
  event loop (``ppswap.transports.mpi_requests``). For ``spin_s`` plus the payload's time at
  1 GB/s a wait spins: it polls in a tight loop for slices of at most ``busy_poll_s``
  (default 200 us, the longest it blocks the loop at a time) and yields (``sleep(0)``)
  between slices. Then it sleeps doubling intervals up to ``poll_interval_s`` between
  single polls.
- Wire format: a header (magic, epoch, identity, byte count, the page offset of the
  sender's body, ``dtype.str``, shape) on tag ``2t``, followed in the same message by a
  payload of up to 16 KiB; a larger payload's raw C-contiguous bytes follow on tag
  ``2t + 1`` and land at the same offset into a page as they left (see
  ``RecvBufferPool``). Any shape and any dtype named by ``dtype.str`` arrives bit-exact;
  object and structured dtypes raise ``TypeError``.
- Tags: P2P uses the layout of ``ppswap/core/p2p_tags.py`` over ``MPI.TAG_UB`` on its own
  duplicate of ``comm``; ``configure`` sets the layout and starts a new epoch.
  Consecutive epochs use disjoint tag ranges while the tags have room for several, so a
  message left over from an earlier run never matches; where they have not (or after as
  many epochs as they have room for), the epoch in the header makes such a message an
  error, never a wrong tensor. Collectives exchange point-to-point messages on a second
  duplicate, tagged by a hash of ``(op, group, key, call number, epoch)`` and checked
  against a digest in the header.
- ``send`` returns when MPI may reuse the buffer: for large payloads, once the receiver
  has posted its receive (rendezvous). A runtime must not make a rank's next receive wait
  for its own earlier send.
- ``close()`` cancels outstanding requests so a failed run does not hang at exit;
  ``abort(errorcode)`` ends every rank of the job (``MPI.COMM_WORLD.Abort``).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt
from mpi4py import MPI

from ppswap.core.messages import MessageKey
from ppswap.core.p2p_tags import P2PTagLayout
from ppswap.core.rank_args import check_int, check_local, check_peer_call, group_index
from ppswap.core.transport import (
    RecvDone,
    SendDone,
    Started,
    TransportStats,
    check_all_to_all,
    complete_all,
    sum_contributions,
)
from ppswap.core.wire import (
    INLINE_MAX_BYTES,
    PAGE_BYTES,
    RecvBufferPool,
    WireCounters,
    decode_header,
    digest,
    encode_message,
    exchange_per_member,
    wire_array,
)
from ppswap.transports.mpi_requests import FIRST_BYTES, InFlightRequests, StartedRecv

__all__ = ["MPITransport"]

Array = npt.NDArray[Any]

_ABORT_GRACE_S = 0.5  # for mpiexec to forward what a failing rank printed (see abort)


class MPITransport:
    """The ``Transport`` of one MPI rank (this process), plus FSDP collectives.

    ``comm`` (default ``MPI.COMM_WORLD``) is duplicated twice at construction, which is a
    collective call: every rank of ``comm`` constructs its transport, in the same order
    relative to its other communicator creations. Ranks are ranks of ``comm``.
    ``abort_on_failure``: a failed run ends every process of the job (``abort``).
    """

    abort_on_failure = True

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        poll_interval_s: float = 1e-3,
        spin_s: float = 1e-3,
        busy_poll_s: float = 200e-6,
        recv_pool_bytes: int = 256 << 20,
    ) -> None:
        if comm is not None and not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py.MPI.Comm or None, got {comm!r}")
        for name, value in (
            ("poll_interval_s", poll_interval_s),
            ("spin_s", spin_s),
            ("busy_poll_s", busy_poll_s),
        ):
            if not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"{name}={value!r}; allowed: a finite number >= 0")
        check_int("recv_pool_bytes", recv_pool_bytes, 0, 1 << 62)
        base = MPI.COMM_WORLD if comm is None else comm
        self._p2p_comm = base.Dup()
        self._coll_comm = base.Dup()
        self._rank = base.Get_rank()
        self._world_size = base.Get_size()
        self._requests = InFlightRequests(
            poll_interval_s=float(poll_interval_s),
            spin_s=float(spin_s),
            busy_poll_s=float(busy_poll_s),
        )
        tag_ub = self._p2p_comm.Get_attr(MPI.TAG_UB)
        self._tag_ub = int(tag_ub) if tag_ub is not None else 32767
        self._tags = P2PTagLayout(self._tag_ub + 1, "MPI tags")
        self._counters = WireCounters()
        self._recv_pool = RecvBufferPool(recv_pool_bytes)
        self._header_buffers: list[bytearray] = []  # free receive buffers of FIRST_BYTES

    # -- properties and set-up --------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in ``comm``."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks in ``comm``."""
        return self._world_size

    @property
    def closed(self) -> bool:
        return self._requests.closed

    def configure(self, num_stages: int, micro_count: int) -> None:
        """Set the P2P tag layout for a run and start a new epoch (``core/p2p_tags.py``).

        Every rank calls it with the same values before the run's first message. Raises
        ValueError when ``4 * num_stages * micro_count`` tags exceed ``MPI.TAG_UB``.
        """
        self._tags.configure(num_stages, micro_count)
        self._counters.collective_calls.clear()

    # -- point to point (the Transport and CallbackTransport protocols) ---------------------

    @property
    def starts_messages(self) -> bool:
        """``start_send`` / ``start_recv`` serve (``CallbackTransport``)."""
        return True

    def start_send(
        self, src: int, dst: int, key: MessageKey, payload: Array, on_done: SendDone
    ) -> Started:
        """``send`` without a task: ``on_done`` on the loop once MPI may reuse the buffer."""
        if not self._p2p_call_ok(src, dst):
            self._check_p2p_call("src", src, "dst", dst)
        body = wire_array(payload, "payload")
        tag, identity = self._tags.address(key)
        done = partial(self._counters.sent_then, body.nbytes, on_done)
        return self._start_message(self._p2p_comm, dst, tag, identity, body, done)

    def start_recv(self, dst: int, src: int, key: MessageKey, on_done: RecvDone) -> Started:
        """``recv`` without a task: ``on_done`` gets the new array on the loop."""
        if not self._p2p_call_ok(dst, src):
            self._check_p2p_call("dst", dst, "src", src)
        tag, identity = self._tags.address(key)
        return StartedRecv(
            self._requests,
            self._p2p_comm,
            src,
            tag,
            (self._tags.epoch, identity),
            ("recv", key, "from rank", src),
            (self._header_buffers, self._recv_pool),
            partial(self._counters.received_then, on_done),
        )

    async def send(self, src: int, dst: int, key: MessageKey, payload: Array) -> None:
        """Send ``payload`` to rank ``dst``; returns once MPI may reuse the buffer."""
        if not self._p2p_call_ok(src, dst):
            self._check_p2p_call("src", src, "dst", dst)
        body = wire_array(payload, "payload")
        tag, identity = self._tags.address(key)
        await self._send_message(self._p2p_comm, dst, tag, identity, body)
        self._counters.count_sent(body.nbytes)

    async def recv(self, dst: int, src: int, key: MessageKey) -> Array:
        """Wait for message ``key`` from rank ``src`` and return a new array holding it."""
        if not self._p2p_call_ok(dst, src):
            self._check_p2p_call("dst", dst, "src", src)
        tag, identity = self._tags.address(key)
        what = ("recv", key, "from rank", src)  # formatted only in an error message
        payload = await self._recv_message(self._p2p_comm, src, tag, identity, what)
        self._counters.received += 1
        return payload

    def stats(self) -> TransportStats:
        """P2P counts of this rank; ``undelivered`` = its sends not yet completed."""
        return self._counters.stats(self._requests.pending_p2p_sends())

    # -- collectives --------------------------------------------------------------------------

    async def all_gather(
        self, rank: int, group: tuple[int, ...], key: str, array: Array
    ) -> list[Array]:
        """Every member's ``array``, in ``group`` order (this rank's entry is ``array``).

        ``rank`` is this process's rank (as ``send``'s ``src``); ``group`` is a tuple of
        distinct ranks containing it, and every member passes the same tuple and ``key``.
        Arrays may differ in shape and dtype between members.
        """
        index = self._check_collective(rank, group)
        body = wire_array(array, "array")
        outgoing = {j: body for j in range(len(group)) if j != index}
        received = await self._exchange("all_gather", group, key, outgoing)
        return [array if j == index else received[j] for j in range(len(group))]

    async def reduce_scatter_sum(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[Array]
    ) -> Array:
        """The sum over members of their ``arrays[i]``, where ``group[i]`` is this rank.

        ``arrays`` has one array per member (``arrays[j]`` goes to ``group[j]``). The sum is
        a left fold in ``group`` order (``a_0 + a_1 + ...``), so it is bit-identical on
        every run; contributions must match this rank's ``arrays[i]`` in shape and dtype.
        """
        _, parts = await self._per_member_exchange("reduce_scatter_sum", rank, group, key, arrays)
        return sum_contributions(key, group, self._rank, parts)

    async def all_to_all(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[Array]
    ) -> list[Array]:
        """What every member sent to this rank (its ``arrays[i]``, ``group[i]`` being this
        rank), in ``group`` order: ``arrays[j]`` goes to ``group[j]``, any number of rows
        (zero included), each message self-describing (``check_all_to_all``)."""
        mine, parts = await self._per_member_exchange("all_to_all", rank, group, key, arrays)
        return check_all_to_all(key, group, self._rank, mine, parts)

    async def _per_member_exchange(
        self, op: str, rank: int, group: tuple[int, ...], key: str, arrays: list[Array]
    ) -> tuple[Array, list[Array]]:
        """Send ``arrays[j]`` to ``group[j]``; this rank's own array (as sent) and what
        every member sent to it, in ``group`` order."""
        index = self._check_collective(rank, group)
        if not isinstance(arrays, Sequence):
            raise TypeError(f"arrays must be a list of arrays, got {type(arrays).__name__}")
        if len(arrays) != len(group):
            raise ValueError(
                f"arrays has {len(arrays)} entries; allowed: {len(group)}, one per member "
                f"of group {group}"
            )
        return await exchange_per_member(arrays, index, partial(self._exchange, op, group, key))

    # -- failure and shutdown -----------------------------------------------------------------

    def close(self) -> None:
        """Cancel every outstanding request, then free the communicators. Idempotent.

        Waits at most about a second for cancelled requests to complete; any left are
        freed (MPI finishes them in the background) so the process can exit.
        """
        if self._requests.closed:
            return
        self._requests.cancel_all()
        self._p2p_comm.Free()
        self._coll_comm.Free()
        self._recv_pool.clear()

    def abort(self, errorcode: int = 1) -> NoReturn:
        """End every process of the MPI job with ``errorcode`` (``COMM_WORLD.Abort``).

        First flushes this process's stdout and stderr and waits ``_ABORT_GRACE_S``:
        mpiexec forwards each rank's output through a proxy that the abort kills, and the
        report a failing rank printed just before (which rank failed, and why) was seen
        lost without that pause.
        """
        check_int("errorcode", errorcode, 0, 256)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or replaced stream
                stream.flush()
        time.sleep(_ABORT_GRACE_S)
        MPI.COMM_WORLD.Abort(errorcode)

    def __enter__(self) -> MPITransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._requests.closed:
            raise RuntimeError("MPITransport is closed")

    def _p2p_call_ok(self, local: object, peer: object) -> bool:
        """The common case of ``_check_p2p_call``, as one expression.

        Each call, lookup and object on a message's path costs 2-5 times its warm time
        here, because the payload's copy has just evicted the caches (about 20 us a
        message at 1 MiB in all); this test replaces three checking calls.
        """
        return (
            not self._requests.closed
            and type(local) is int
            and local == self._rank
            and type(peer) is int
            and 0 <= peer < self._world_size
        )

    def _check_p2p_call(self, local_name: str, local: object, peer_name: str, peer: object) -> None:
        """Raise unless the transport is open, ``local`` is this rank and ``peer`` a rank."""
        self._check_open()
        check_peer_call(local_name, local, peer_name, peer, self._rank, self._world_size)

    def _check_collective(self, rank: int, group: tuple[int, ...]) -> int:
        """This rank's index in ``group``, after checking the call."""
        self._check_open()
        check_local("rank", rank, self._rank)
        return group_index(group, self._rank, self._world_size)

    def _collective_tag(self, op: str, group: tuple[int, ...], key: str) -> tuple[int, int]:
        """``(tag, identity)`` of this rank's next ``op`` call on ``(group, key)``."""
        members, call = self._counters.next_call(op, group, key)
        tag_hash = digest(op, members, key, call, self._tags.epoch) % ((self._tag_ub + 1) // 2)
        return 2 * tag_hash, digest(op, group, key, call)

    async def _exchange(
        self, op: str, group: tuple[int, ...], key: str, outgoing: dict[int, Array]
    ) -> dict[int, Array]:
        """Send ``outgoing[j]`` to and receive from ``group[j]`` for every ``j``, at once
        (every message started, no task each), as this rank's next ``op`` call on
        ``(group, key)`` (``_collective_tag``). The first failure is raised as itself."""
        tag, identity = self._collective_tag(op, group, key)
        comm = self._coll_comm
        header = (self._tags.epoch, identity)
        buffers = (self._header_buffers, self._recv_pool)
        starts: list[Callable[[Callable[..., None]], Started]] = []
        for j, body in outgoing.items():
            what = ("collective", key, "from rank", group[j])
            starts.append(partial(self._start_message, comm, group[j], tag, identity, body))
            starts.append(
                partial(StartedRecv, self._requests, comm, group[j], tag, header, what, buffers)
            )
        results = await complete_all(starts)
        return {j: results[2 * n + 1] for n, j in enumerate(outgoing)}

    def _start_message(
        self, comm: MPI.Comm, dst: int, tag: int, identity: int, body: Array, on_done: SendDone
    ) -> Started:
        requests, buffers = self._post_message(comm, dst, tag, identity, body)
        return self._requests.start(requests, buffers, comm is self._p2p_comm, body.nbytes, on_done)

    def _post_message(
        self, comm: MPI.Comm, dst: int, tag: int, identity: int, body: Array
    ) -> tuple[list[MPI.Request], tuple[object, ...]]:
        """Post a message's sends: the requests and the buffers they read."""
        separate_body = body.nbytes > INLINE_MAX_BYTES
        # MPI.buffer(...).address: 0.5 us, where body.ctypes.data takes 1.5-2.5
        page_offset = MPI.buffer(body).address % PAGE_BYTES if separate_body else 0
        message = encode_message(self._tags.epoch, identity, body, page_offset)
        requests = [comm.Isend(message, dst, tag)]
        if separate_body:
            # [array, BYTE] sends the raw bytes of any dtype; 1 us cheaper than a uint8 view
            requests.append(comm.Isend([body, MPI.BYTE], dst, tag + 1))
        return requests, (message, body)

    async def _send_message(
        self, comm: MPI.Comm, dst: int, tag: int, identity: int, body: Array
    ) -> None:
        requests, buffers = self._post_message(comm, dst, tag, identity, body)
        p2p_send = comm is self._p2p_comm
        await self._requests.complete(requests, buffers, p2p_send, body.nbytes)

    async def _recv_message(
        self, comm: MPI.Comm, src: int, tag: int, identity: int, what: tuple[object, ...]
    ) -> Array:
        # header buffers are reused: a fresh 16 KiB allocation per message cost 1-2 us
        first = self._header_buffers.pop() if self._header_buffers else bytearray(FIRST_BYTES)
        await self._requests.complete([comm.Irecv(first, src, tag)], (first,), False, 0)
        nbytes, dtype, shape, size, page_offset = decode_header(
            first, self._tags.epoch, identity, what
        )
        inline = first[size : size + nbytes] if nbytes <= INLINE_MAX_BYTES else None  # a copy
        self._header_buffers.append(first)
        if inline is not None:
            raw = np.frombuffer(inline, dtype=np.uint8)
        else:
            raw = self._recv_pool.take(nbytes, page_offset)  # lies in its page as the sender's
            await self._requests.complete([comm.Irecv(raw, src, tag + 1)], (raw,), False, nbytes)
        # a view whose base is the pool's block (or the copy): cheaper than
        # raw.view(dtype).reshape(shape)
        return np.ndarray(shape, dtype, raw)
