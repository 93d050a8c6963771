"""``TorchDistTransport``: the P2P ``Transport`` (and FSDP's collectives) over torch.distributed.

One process per rank, launched with ``torchrun``; ``docs/torch_dist.md`` has the recipe,
the design and the measured figures. In short:

- Construction creates the transport's own gloo group (a collective call, like
  ``MPI.Comm.Dup``), so its tags never meet the application's. Messages use
  ``MPITransport``'s wire format (``ppswap.core.wire``): a header on tag ``2t`` carrying
  payloads of up to ``inline_max_bytes`` (1 MiB by default; the same on every rank,
  checked at construction), a larger payload's raw bytes on tag ``2t + 1``
  (``distributed_io``).
- gloo matches a receive by ``(source, tag)``, in posting order within a tag (verified,
  torch 2.13). P2P tags lie below 2**30, in the layout of ``ppswap/core/p2p_tags.py``
  (a range per epoch, ``configure``); collectives use hashed tags from 2**30 up (tags
  are int32).
- Works are posted from the event loop and completed by daemon threads
  (``distributed_wait``: gloo's ``is_completed()`` stays False until ``wait()``). A
  posted gloo operation cannot be withdrawn: a cancelled one stays posted until matched,
  until its peer exits, or until ``timeout_s`` (gloo then closes the group). gloo sends
  are rendezvous: ``send`` returns once the receiver has posted the receive.
- ``backend="nccl"`` (untested here: no GPU) sends bodies over NCCL, staged through CUDA
  tensors, and keeps headers on gloo (``distributed_io``).
- Messages to this rank itself stay in the process (gloo has no self connection).
- ``close()`` fails every waiting call and destroys the groups the transport created;
  ``abort(errorcode)`` ends this process (``os._exit``), and torchrun stops the others.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, NoReturn

import anyio
import numpy.typing as npt
import torch
import torch.distributed as dist

from ppswap.backends.torch.distributed_io import DEFAULT_INLINE_MAX_BYTES, MessageIO
from ppswap.core.messages import MessageKey
from ppswap.core.p2p_tags import P2PTagLayout
from ppswap.core.rank_args import check_int, check_local, check_peer_call, group_index
from ppswap.core.transport import (
    FINISHED,
    RecvDone,
    SendDone,
    Started,
    TransportStats,
    check_all_to_all,
    complete_all,
    sum_contributions,
)
from ppswap.core.wire import WireCounters, digest, exchange_per_member, wire_array

__all__ = ["P2P_TAGS", "TorchDistTransport"]

Array = npt.NDArray[Any]

P2P_TAGS = 1 << 30  # P2P tags lie below, collective tags from here up to 2**31 - 1
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_CLOSE_GRACE_S = 3.0
_INLINE_LIMIT = 64 << 20  # every posted receive holds a buffer of the inline limit
_SECONDARY_ABORT_DELAY_S = 1.0


def _init_default_group(backend: str, timeout: timedelta) -> None:
    """``init_process_group`` from torchrun's environment (``env://``), or say what is missing."""
    missing = [name for name in _ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"torch.distributed is not initialized and {', '.join(missing)} not set: launch "
            "with torchrun, or call torch.distributed.init_process_group first"
        )
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timeout)


def _check_same_everywhere(name: str, value: int, group: dist.ProcessGroup) -> None:
    """Raise ValueError on every rank unless every rank of ``group`` passed ``value``."""
    values = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(values, torch.tensor([value], dtype=torch.int64), group=group)
    found = [int(v.item()) for v in values]
    if len(set(found)) > 1:
        raise ValueError(
            f"{name} must be the same on every rank, got {found} by rank: a receiver sizes "
            "its buffers by its own value, and the senders must keep to it"
        )


class _SelfReceive:
    """A started receive of a message from this rank to itself."""

    __slots__ = ("_key", "_on_done", "_waiting")

    def __init__(
        self, waiting: dict[MessageKey, RecvDone], key: MessageKey, on_done: RecvDone
    ) -> None:
        self._waiting, self._key, self._on_done = waiting, key, on_done

    def cancel(self) -> None:
        if self._waiting.get(self._key) is self._on_done:
            del self._waiting[self._key]


class TorchDistTransport:
    """The ``Transport`` of one torch.distributed rank (this process), plus FSDP collectives.

    Uses the default process group, and initializes it from torchrun's environment
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK picks the CUDA device for
    NCCL) if there is none yet; ``close()`` then destroys it too. Construction is a
    collective call: every rank constructs its transport, in the same order relative to
    its other group creations. Ranks are global ranks. ``timeout_s`` bounds every gloo
    operation; ``abort_on_failure`` asks the runtime to ``abort`` the job when this rank
    fails (``ppswap.transports.distributed.abort_job``). Payloads of up to ``inline_max_bytes``
    travel in one message (copied into it), larger ones as a second message of their own
    bytes; every rank must pass the same value (a mismatch raises ``ValueError`` on every
    rank).
    """

    def __init__(
        self,
        *,
        backend: str = "gloo",
        timeout_s: float = 1800.0,
        recv_pool_bytes: int = 256 << 20,
        abort_on_failure: bool = True,
        inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}; allowed: 'gloo' or 'nccl'")
        if not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s={timeout_s!r}; allowed: a finite number > 0")
        check_int("recv_pool_bytes", recv_pool_bytes, 0, 1 << 62)
        check_int("inline_max_bytes", inline_max_bytes, 0, _INLINE_LIMIT + 1)
        timeout = timedelta(seconds=timeout_s)
        self._owns_default_group = not dist.is_initialized()
        if self._owns_default_group:
            _init_default_group(backend, timeout)
        self._groups: list[dist.ProcessGroup] = []
        try:
            self._groups.append(dist.new_group(backend="gloo", timeout=timeout))
            device = (
                None if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
            )
            if backend == "nccl":  # bodies: one group low -> high ranks, one high -> low
                self._groups += [dist.new_group(backend="nccl", timeout=timeout) for _ in "lh"]
            _check_same_everywhere("inline_max_bytes", inline_max_bytes, self._groups[0])
        except BaseException:
            self._destroy_groups()
            self._groups.clear()  # not held by the traceback (close()'s comment says why)
            raise
        self.abort_on_failure = abort_on_failure
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._tags = P2PTagLayout(P2P_TAGS)
        self._counters = WireCounters()
        self._io = MessageIO(self._groups, device, recv_pool_bytes, inline_max_bytes)
        self._device = device
        self._to_self: dict[MessageKey, Array] = {}  # messages to this rank itself
        self._self_waiters: dict[MessageKey, anyio.Event] = {}
        self._self_callbacks: dict[MessageKey, RecvDone] = {}

    # -- properties and set-up --------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self._world_size

    @property
    def closed(self) -> bool:
        return self._io.waiters.closed

    def configure(self, num_stages: int, micro_count: int) -> None:
        """Set the P2P tag layout for a run and start a new epoch (``core/p2p_tags.py``).

        Every rank calls it with the same values before the run's first message. Raises
        ValueError when ``4 * num_stages * micro_count`` tags exceed 2**30.
        """
        self._tags.configure(num_stages, micro_count)
        self._to_self.clear()
        self._self_callbacks.clear()
        self._counters.collective_calls.clear()

    # -- point to point (the Transport protocol) --------------------------------------------

    @property
    def starts_messages(self) -> bool:
        """Whether ``start_send`` / ``start_recv`` serve (gloo bodies; not NCCL's)."""
        return self._device is None

    def start_send(
        self, src: int, dst: int, key: MessageKey, payload: Array, on_done: SendDone
    ) -> Started:
        """``send`` without a task (``CallbackTransport``): ``on_done`` on the loop."""
        self._check_p2p_call("src", src, "dst", dst)
        body = wire_array(payload, "payload")
        tag, identity = self._tags.address(key)
        if dst == self._rank:
            self._to_this_rank(src, key, body)
            on_done(None)
            return FINISHED
        what = ("send", key, "to rank", dst)
        done = partial(self._counters.sent_then, body.nbytes, on_done)
        return self._io.start_send(dst, tag, (self._tags.epoch, identity), body, what, done)

    def start_recv(self, dst: int, src: int, key: MessageKey, on_done: RecvDone) -> Started:
        """``recv`` without a task (``CallbackTransport``): ``on_done`` on the loop."""
        return self._start_recv(dst, src, key, on_done, None)

    def start_recv_landing(
        self,
        dst: int,
        src: int,
        key: MessageKey,
        on_done: RecvDone,
        on_landed: Callable[[Array], object],
    ) -> Started:
        """``start_recv`` that also hands the payload to ``on_landed`` on the waiting
        thread, before ``on_done`` (``LandingTransport``; not for a message from this
        rank to itself, which never leaves the loop)."""
        return self._start_recv(dst, src, key, on_done, on_landed)

    def _start_recv(
        self,
        dst: int,
        src: int,
        key: MessageKey,
        on_done: RecvDone,
        on_landed: Callable[[Array], object] | None,
    ) -> Started:
        self._check_p2p_call("dst", dst, "src", src)
        tag, identity = self._tags.address(key)
        if src == self._rank:
            if key in self._to_self:
                self._counters.received += 1
                on_done(self._to_self.pop(key), None)
                return FINISHED
            if key in self._self_waiters or key in self._self_callbacks:
                raise RuntimeError(f"message {key} from rank {src} to itself received twice")
            self._self_callbacks[key] = on_done
            return _SelfReceive(self._self_callbacks, key, on_done)
        what = ("recv", key, "from rank", src)
        done = partial(self._counters.received_then, on_done)
        return self._io.start_recv(src, tag, (self._tags.epoch, identity), what, done, on_landed)

    async def send(self, src: int, dst: int, key: MessageKey, payload: Array) -> None:
        """Send ``payload`` to rank ``dst``; returns once its buffer may be reused."""
        self._check_p2p_call("src", src, "dst", dst)
        body = wire_array(payload, "payload")
        tag, identity = self._tags.address(key)
        if dst == self._rank:
            self._to_this_rank(src, key, body)
            return
        what = ("send", key, "to rank", dst)
        await self._io.send(dst, tag, (self._tags.epoch, identity), body, what)
        self._counters.count_sent(body.nbytes)

    async def recv(self, dst: int, src: int, key: MessageKey) -> Array:
        """Wait for message ``key`` from rank ``src`` and return a new array holding it."""
        self._check_p2p_call("dst", dst, "src", src)
        tag, identity = self._tags.address(key)
        if src == self._rank:
            if key not in self._to_self:
                if key in self._self_waiters or key in self._self_callbacks:
                    raise RuntimeError(f"message {key} from rank {src} to itself received twice")
                self._self_waiters[key] = event = anyio.Event()
                try:
                    await event.wait()
                finally:
                    del self._self_waiters[key]
                self._check_open()
            payload = self._to_self.pop(key)
        else:
            what = ("recv", key, "from rank", src)
            payload = await self._io.recv(src, tag, (self._tags.epoch, identity), what)
        self._counters.received += 1
        return payload

    def _to_this_rank(self, src: int, key: MessageKey, body: Array) -> None:
        """A message to this rank itself: kept in the process (a copy), or handed to the
        receive that waits for it."""
        if key in self._to_self:
            raise RuntimeError(f"message {key} from rank {src} to itself sent twice")
        self._counters.count_sent(body.nbytes)
        on_arrival = self._self_callbacks.pop(key, None)
        if on_arrival is not None:
            self._counters.received += 1
            on_arrival(body.copy(), None)
            return
        self._to_self[key] = body.copy()
        if key in self._self_waiters:
            self._self_waiters[key].set()

    def stats(self) -> TransportStats:
        """P2P counts of this rank; ``undelivered`` = its sends not yet completed."""
        return self._counters.stats(self._io.waiters.pending_sends)

    # -- collectives (point-to-point exchanges among the members) ---------------------------

    async def all_gather(
        self, rank: int, group: tuple[int, ...], key: str, array: Array
    ) -> list[Array]:
        """Every member's ``array``, in ``group`` order (this rank's entry is ``array``).

        ``rank`` is this process's rank; ``group`` is a tuple of distinct ranks holding
        it, the same tuple on every member, as is ``key``. Shapes and dtypes may differ.
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

        ``arrays[j]`` goes to ``group[j]``. The sum is a left fold in ``group`` order
        (``a_0 + a_1 + ...``, as ``InProcessTransport``'s), bit-identical on every run;
        contributions must match this rank's ``arrays[i]`` in shape and dtype.
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
        if not isinstance(arrays, Sequence) or len(arrays) != len(group):
            raise ValueError(f"arrays must be a list of {len(group)} arrays, one per member")
        return await exchange_per_member(arrays, index, partial(self._exchange, op, group, key))

    # -- failure and shutdown -----------------------------------------------------------------

    def close(self) -> None:
        """Fail every waiting call, destroy the groups this transport created, and give
        operations a cancelled wait left posted ``_CLOSE_GRACE_S`` to end. Idempotent.

        Those end as their peers close their groups or exit; one still posted when Python
        finalizes can kill the process (``distributed_wait``'s doc). Once every one ended,
        the transport's waiting threads are joined and its groups dropped, which ends their
        gloo threads: nothing of it runs on when the interpreter finalizes. Call it on the
        event loop's thread or after the loop ended.
        """
        if self._io.waiters.closed:
            return
        self._io.waiters.close()
        for event in self._self_waiters.values():
            event.set()
        callbacks, self._self_callbacks = list(self._self_callbacks.values()), {}
        for on_done in callbacks:
            on_done(None, RuntimeError("TorchDistTransport was closed while a message was awaited"))
        self._destroy_groups()
        self._io.clear()
        if self._io.waiters.drain(_CLOSE_GRACE_S) == 0:
            # destroy_process_group leaves a gloo group's threads running while Python
            # holds the group; dropped here they are joined now, not while the
            # interpreter finalizes (where one releasing a tensor aborts the process).
            self._groups.clear()

    def abort(self, errorcode: int = 1) -> NoReturn:
        """End this process with ``errorcode`` (``os._exit``), after flushing stdout/stderr.

        Under torchrun the agent then stops every other rank (SIGTERM) and exits non-zero;
        without it, the peers' pending operations fail as the connections close. A rank
        whose own operation failed in gloo (most likely because another rank ended first)
        waits ``_SECONDARY_ABORT_DELAY_S`` before it exits, so that torchrun's summary
        names the rank that failed first as the root cause.
        """
        check_int("errorcode", errorcode, 0, 256)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or replaced stream
                stream.flush()
        if self._io.peer_failed:  # likely a consequence: let torchrun see the first failure first
            time.sleep(_SECONDARY_ABORT_DELAY_S)
        os._exit(errorcode)

    def __enter__(self) -> TorchDistTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _destroy_groups(self) -> None:
        for group in self._groups:
            with contextlib.suppress(Exception):  # already gone with a failed peer
                dist.destroy_process_group(group)
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._io.waiters.closed:
            raise RuntimeError("TorchDistTransport is closed")

    def _check_p2p_call(self, local_name: str, local: object, peer_name: str, peer: object) -> None:
        """Raise unless the transport is open, ``local`` is this rank and ``peer`` a rank."""
        self._check_open()
        check_peer_call(local_name, local, peer_name, peer, self._rank, self._world_size)

    def _check_collective(self, rank: int, group: tuple[int, ...]) -> int:
        """This rank's index in ``group``, after checking the call."""
        self._check_open()
        check_local("rank", rank, self._rank)
        return group_index(group, self._rank, self._world_size)

    async def _exchange(
        self, op: str, group: tuple[int, ...], key: str, outgoing: dict[int, Array]
    ) -> dict[int, Array]:
        """Send ``outgoing[j]`` to and receive from ``group[j]`` for every ``j``, at once.

        The tag hashes ``(op, sorted group, key, call number, epoch)``; the header carries
        a digest of ``(op, group, key, call number)``. The first failure is raised as itself.
        """
        members, call = self._counters.next_call(op, group, key)
        tag = P2P_TAGS + 2 * (digest(op, members, key, call, self._tags.epoch) % (P2P_TAGS // 2))
        identity = digest(op, group, key, call)
        header = (self._tags.epoch, identity)
        if self._device is None:  # gloo: every message started, no task each
            starts: list[Callable[[Callable[..., None]], Started]] = []
            for j, body in outgoing.items():
                to, back = [(op, repr(key), way, group[j]) for way in ("to rank", "from rank")]
                send = partial(self._io.start_send, group[j], tag, header, body, to, p2p_send=False)
                starts += [send, partial(self._io.start_recv, group[j], tag, header, back)]
            results = await complete_all(starts)
            return {j: results[2 * n + 1] for n, j in enumerate(outgoing)}
        received: dict[int, Array] = {}

        async def receive(j: int) -> None:
            what = (op, repr(key), "from rank", group[j])
            received[j] = await self._io.recv(group[j], tag, header, what)

        try:
            async with anyio.create_task_group() as tg:
                for j, body in outgoing.items():
                    what = (op, repr(key), "to rank", group[j])
                    tg.start_soon(self._io.send, group[j], tag, header, body, what, False)
                    tg.start_soon(receive, j)
        except ExceptionGroup as errors:
            raise errors.exceptions[0] from None
        return received
