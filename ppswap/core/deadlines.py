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

__all__ = ["DEFAULT_STEP_TIMEOUT_S", "resolve", "wait_woken"]

# The deadline of every single wait (a receive, a copy, a collective, a compute job), not
# of the run; the one default of it (``RunOptions.step_timeout``, which every actor and the
# swap session get from the run). The longest legitimate wait is a receive on the last
# rank during the pipeline fill (about 2 * pp compute slots) or a first step that compiles
# kernels; five minutes is far above that for the models this runtime serves, and short
# enough that a service learns of a hang in minutes (torch.distributed's NCCL default is
# ten). Raise it for very slow steps; math.inf turns the watchdog off.
DEFAULT_STEP_TIMEOUT_S = 300.0


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
