"""Deadlines on the hot path's waits, as one event-loop timer each.

An anyio cancel scope with a deadline costs about 10 us to enter and leave (a scope
object, the backend lookup, a timer, the task's cancel state); the runtime waits two or
three times per step (a compute job, a received payload, a copy). ``wait_woken`` awaits a
future the caller owns (nobody else resolves it with a value that matters) and arms one
``loop.call_later`` timer that resolves it with ``None`` at the deadline: the caller then
sees that what it waited for has not happened and reports the missed deadline itself.
Cancellation is unchanged: cancelling the awaiting task (an anyio cancel scope around it)
cancels the future and raises in the task, as for any await.

These helpers need the asyncio backend, as ``DedicatedThread`` does.
"""

from __future__ import annotations

import asyncio
import math

__all__ = ["resolve", "wait_woken"]


def resolve(future: asyncio.Future[None]) -> None:
    """Resolve ``future`` with ``None`` unless it is done (event loop thread)."""
    if not future.done():
        future.set_result(None)


async def wait_woken(future: asyncio.Future[None], timeout_s: float) -> None:
    """Await ``future``, resolved with ``None`` after ``timeout_s`` at the latest (an
    infinite timeout arms no timer). The caller checks whether its condition holds."""
    if timeout_s == math.inf:
        await future
        return
    timer = asyncio.get_running_loop().call_later(max(timeout_s, 0.0), resolve, future)
    try:
        await future
    finally:
        timer.cancel()
