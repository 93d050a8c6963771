"""Completing torch.distributed works for the event loop (``TorchDistTransport``'s).

gloo's point-to-point ``Work`` reports ``is_completed()`` only once ``wait()`` has been
called (torch 2.13: it stays False after the data has landed; ``get_future`` is not
implemented for it; a ``wait(timeout)`` that expires closes every connection of the
group). So ``Waiters`` hands a message's works to a daemon thread that blocks in
``wait()`` (which releases the GIL) and wakes the loop with ``call_soon_threadsafe`` when
they are done; the loop itself never blocks. ``submit`` calls back on the loop
(``TorchDistTransport.start_send`` / ``start_recv``: no task per message),
``complete`` is its awaitable form. NCCL works do report completion, and their
``wait()`` only orders CUDA streams, so the thread polls ``is_completed()`` for them.

Threads are reused (one job at a time each) and are daemon threads: a gloo wait cannot be
withdrawn, and one left waiting must not keep the process from exiting. A cancelled
``complete`` (or job) returns at once; its thread waits on until gloo completes or fails the work
(when the peer closes its group or exits, or at the group's timeout). A daemon thread
that returns from ``wait()`` while Python finalizes kills the process (pybind11 cannot
unwind the thread: "terminate called without an active exception", SIGABRT; measured),
so ``drain`` gives such threads a grace period to end first, and joins every thread that
ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from ppswap.core.transport import call_back

__all__ = ["Done", "Posted", "Then", "Waiters", "WorkError", "host_tensor"]

Posted = list[tuple[dist.Work, bool]]
"""A message's works, each with whether it is polled (NCCL) rather than waited (gloo)."""
Then = Callable[[], Posted | None]
"""Runs on the waiting thread once the works completed; the works it returns are waited
too (a receive posts the body's receive once the header has arrived: one wake-up)."""
Done = Callable[[BaseException | None], None]
"""Called back on the loop once a job ended: ``None``, or what failed."""

_POLL_S = 50e-6
_CLOSED = "TorchDistTransport was closed while a message was in flight"


class WorkError(RuntimeError):
    """A posted operation failed (gloo: the peer closed the connection, its process ended,
    or the group's timeout passed); the message is torch's."""


def host_tensor(array: npt.NDArray[Any]) -> torch.Tensor:
    """The bytes of the C-contiguous ``array`` as a 1-d uint8 tensor on its memory (no copy)."""
    raw = array.reshape(-1).view(np.uint8)
    if raw.flags.writeable:
        return torch.from_numpy(raw)
    with warnings.catch_warnings():  # torch warns about read-only arrays; it only reads them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


@dataclass(slots=True, eq=False)
class _Job:
    """A message's works on a waiting thread; ``on_done`` until it is called or cancelled."""

    works: Posted
    then: Then | None  # runs on the thread once the works completed
    landed: Callable[[], None] | None  # runs on the thread once every work completed
    p2p_send: bool
    loop: asyncio.AbstractEventLoop
    on_done: Done | None
    keep: object  # what the works read or write, alive until they ended

    def cancel(self) -> None:
        """Its callback will not run; the thread waits on (a gloo work cannot be withdrawn)."""
        self.on_done = None


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class Waiters:
    """The waiting threads of one transport. ``submit`` and ``complete`` are called on the
    event loop."""

    def __init__(self) -> None:
        self.closed = False
        self.pending_sends = 0  # P2P sends whose works have not completed
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # notified when a job ends
        self._busy = 0  # jobs on a thread
        self._idle: list[queue.SimpleQueue[_Job | None]] = []
        self._threads: list[threading.Thread] = []  # every waiting thread started
        self._waiting: set[_Job] = set()  # jobs whose thread has not reported back
        # per loop, the jobs that ended and wait for the loop to call them back
        self._ended_jobs: dict[asyncio.AbstractEventLoop, list[tuple[_Job, BaseException | None]]]
        self._ended_jobs = {}

    async def complete(
        self, works: Posted, then: Then | None = None, p2p_send: bool = False
    ) -> None:
        """Wait for ``works``, run ``then`` on the thread and wait for the works it returns;
        raise what any of them raised.

        ``p2p_send`` counts the works in ``pending_sends`` until they complete. Raises
        ``RuntimeError`` if the transport is closed, or gets closed while waiting.
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.submit(works, then, p2p_send, partial(_settle, future))
        await future  # cancelled: the thread waits on

    def submit(
        self,
        works: Posted,
        then: Then | None,
        p2p_send: bool,
        on_done: Done,
        keep: object = None,
        landed: Callable[[], None] | None = None,
    ) -> _Job:
        """Wait for ``works`` (then for those ``then`` returns) on a thread; ``on_done`` gets
        ``None`` or what failed, on the loop, unless the returned job is cancelled first.

        ``keep`` stays referenced until the works ended (the buffers they use); ``landed``
        runs on the thread once every work completed, before the loop is told (what it
        raises is the job's failure). Raises ``RuntimeError`` if the transport is closed;
        ``close()`` fails a waiting job.
        """
        if self.closed:
            raise RuntimeError("TorchDistTransport is closed")
        job = _Job(works, then, landed, p2p_send, asyncio.get_running_loop(), on_done, keep)
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
            self._busy += 1
        if jobs is None:
            jobs = queue.SimpleQueue()
            name = "ppswap-torch-dist-wait"
            thread = threading.Thread(target=self._serve, args=(jobs,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        self.pending_sends += p2p_send
        self._waiting.add(job)
        jobs.put(job)
        return job

    def start(
        self, works: Posted, p2p_send: bool, on_error: Callable[[BaseException], None]
    ) -> None:
        """Wait for ``works`` in the background (nobody awaits them); a failure goes to
        ``on_error`` on the loop. Raises ``RuntimeError`` if the transport is closed."""

        def done(error: BaseException | None) -> None:
            if error is not None:
                on_error(error)

        self.submit(works, None, p2p_send, done)

    def close(self) -> None:
        """Fail every waiting job (``RuntimeError``) and stop the idle threads (busy ones
        end later). Call it on the loop's thread, or after the loop ended.
        """
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for jobs in idle:
            jobs.put(None)
        for job in list(self._waiting):
            on_done, job.on_done = job.on_done, None
            if on_done is not None:
                with contextlib.suppress(RuntimeError):  # its loop is closed
                    on_done(RuntimeError(_CLOSED))

    def drain(self, timeout_s: float) -> int:
        """After ``close()``: wait up to ``timeout_s`` for every job to end and join the
        threads that ended; the number of jobs still on a thread (their threads stay)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._ended.wait_for(lambda: self._busy == 0, timeout=timeout_s)
            busy = self._busy
        if self.closed:  # no thread starts any more; an idle one returns at once
            for thread in self._threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            self._threads = [thread for thread in self._threads if thread.is_alive()]
        return busy

    def _serve(self, jobs: queue.SimpleQueue[_Job | None]) -> None:
        while (job := jobs.get()) is not None:
            self._notify(job, self._run(job))
            del job  # no reference to a work, a tensor or a buffer while idle
            with self._lock:
                self._busy -= 1
                self._ended.notify_all()
                if self.closed:
                    return
                self._idle.append(jobs)

    def _run(self, job: _Job) -> BaseException | None:
        """Wait for the job's works, then for those ``then`` returns; what failed, if any.

        The works are dropped here, not on the loop: a gloo ``Work``'s destructor releases
        the GIL, and taking it back from the compute thread cost the loop 150-260 us per
        message (measured).
        """
        works: Posted | None = job.works
        then = job.then
        job.works = []
        try:
            while works:
                for work, polled in works:
                    while polled and not work.is_completed():
                        if self.closed:
                            raise RuntimeError(_CLOSED)
                        time.sleep(_POLL_S)
                    try:
                        work.wait()  # gloo: ends by the group's timeout at the latest
                    except Exception as exc:
                        raise WorkError(str(exc)) from exc
                works, then = (None if then is None else then()), None
            if job.landed is not None:
                job.landed()
        except Exception as exc:
            return exc
        return None

    def _notify(self, job: _Job, error: BaseException | None) -> None:
        """Thread: hand an ended job to its loop, one wake-up for the jobs that end before
        the loop runs (as ``DedicatedThread`` delivers its jobs)."""
        loop = job.loop
        with self._lock:
            burst = self._ended_jobs.get(loop)
            if burst is not None:
                burst.append((job, error))
                return
            self._ended_jobs[loop] = [(job, error)]
        try:
            loop.call_soon_threadsafe(self._deliver, loop)
        except RuntimeError:  # the loop is closed: nobody waits for these jobs any more
            with self._lock:
                self._ended_jobs.pop(loop, None)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        """Event loop: call back every job that ended since the last call."""
        with self._lock:
            ended = self._ended_jobs.pop(loop, [])
        for job, error in ended:
            self._resolve(job, error)  # a callback that raises is reported by call_back

    def _resolve(self, job: _Job, error: BaseException | None) -> None:
        self.pending_sends -= job.p2p_send
        self._waiting.discard(job)
        job.then, job.landed, job.keep = None, None, None  # the thread is done
        on_done, job.on_done = job.on_done, None
        if on_done is not None:  # not cancelled, not failed by close()
            call_back(on_done, error)
