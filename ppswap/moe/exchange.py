"""A rank's all-to-all over its EP group, as the compute thread sees it.

``AllToAll.all_to_all(key, arrays)`` sends ``arrays[j]`` to EP member ``j`` and returns
what every member sent here, in member order (host arrays, any number of rows each). A
MoE block calls it inside its forward and backward, on the compute thread.

``ExpertExchange`` posts each call as a ``CollectiveRequest`` to the rank's P2P actor
through the event loop (``loop_caller``: FIFO, never blocking the thread), like FSDP's
collectives; the P2P actor awaits the transport's ``all_to_all`` on the loop, and the
reply lands an ``Arrival`` the compute thread waits for, with the step deadline: a missed
deadline is a ``PipelineHangError`` naming the rank and the step, a peer that sent rows
of another shape or dtype a ``PipelineError`` from the P2P actor. ``suspend``, where
given, is called with the ``Arrival`` before the wait when it is not there yet: a body
running as a fiber (``ppswap.core.fiber``) gives the thread up there until it is (then
``suspend`` returns True) instead of blocking it.

``AllToAll`` and ``LocalExchange`` (the one-member group) are in ``ppswap.core.all_to_all``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from ppswap.core.all_to_all import AllToAll, LocalExchange
from ppswap.core.arrival import Arrival, ArrivalTimeoutError
from ppswap.core.messages import CollectiveRequest, HostArray, ReplyFuture, RequestSink
from ppswap.errors import PipelineHangError
from ppswap.scheduler.steps import MetaStep

__all__ = ["AllToAll", "ExpertExchange", "LocalExchange"]


class ExpertExchange:
    """World rank ``rank``'s all-to-all over ``group`` (module docstring). ``post`` is a
    ``loop_caller()`` made on the run's loop; ``sink`` the rank's P2P channel; ``where``
    says which step the compute thread is at (requests and errors name it); ``dump``
    gives the flight recorder's state for a hang error."""

    def __init__(
        self,
        *,
        rank: int,
        group: tuple[int, ...],
        post: Callable[..., None],
        sink: RequestSink,
        where: Callable[[], MetaStep],
        timeout_s: float = math.inf,
        suspend: Callable[[Arrival], bool] | None = None,
        dump: Callable[[], str] | None = None,
    ) -> None:
        if rank not in group:
            raise ValueError(f"rank must be a member of group {group}, got {rank}")
        self.rank = rank
        self.group = group
        self._post = post
        self._sink = sink
        self._where = where
        self._timeout_s = timeout_s
        self._suspend = suspend
        self._dump = dump
        self.exchanges = 0

    @property
    def size(self) -> int:
        return len(self.group)

    @property
    def index(self) -> int:
        return self.group.index(self.rank)

    def all_to_all(self, key: str, arrays: Sequence[HostArray]) -> list[HostArray]:
        """Compute thread: post the all-to-all and wait for its reply (module docstring).
        The n-th call of ``key`` meets every member's n-th call of it."""
        if len(arrays) != len(self.group):
            raise ValueError(
                f"all_to_all {key!r}: one array per member of group {self.group}, got {len(arrays)}"
            )
        step = self._where()
        label = f"all_to_all {key}"
        arrival = Arrival(label)
        reply: ReplyFuture[tuple[HostArray, ...]] = ReplyFuture(label, arrival)
        payload = tuple(np.ascontiguousarray(a) for a in arrays)
        self._post(
            self._send, CollectiveRequest(step, "all_to_all", self.group, key, payload, reply)
        )
        self.exchanges += 1
        timeout_s = self._timeout_s
        if self._suspend is not None and not arrival.ready and self._suspend(arrival):
            timeout_s = 0.0  # resumed when it is there, or its deadline passed
        try:
            received: tuple[HostArray, ...] = arrival.wait(timeout_s)
        except ArrivalTimeoutError as exc:
            raise PipelineHangError(
                f"{label} over ranks {self.group} not complete within {self._timeout_s}s",
                rank=self.rank,
                actor="compute",
                step=step.short(),
                dump="" if self._dump is None else self._dump(),
            ) from exc
        return list(received)

    def _send(self, request: CollectiveRequest) -> None:
        """Event loop: post to the P2P actor; a failure to post fails the reply."""
        try:
            self._sink.send_nowait(request)
        except Exception as exc:
            request.reply.fail(exc)
