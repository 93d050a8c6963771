"""TorchDistTransport's callback side (``CallbackTransport``) inside this one process.

The waiting threads' ``submit`` with stand-in works (completion, failure, cancellation,
``close``), and ``start_send`` / ``start_recv`` of messages to this rank itself (a world
of one: gloo has no connection from a rank to itself). Messages between processes take
this path in the pipelines of ``test_torch_dist_pipeline.py`` and the other torchrun
suites (the P2P actor serves the transport through it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("torch")
import torch.distributed as dist
from fake_work import FakeWork

from ppswap.backends.torch.distributed import TorchDistTransport
from ppswap.backends.torch.distributed_wait import Waiters, WorkError
from ppswap.core.messages import MessageKey
from ppswap.core.transport import CallbackTransport

Array = npt.NDArray[Any]


@pytest.fixture
def transport() -> Iterator[TorchDistTransport]:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with TorchDistTransport(timeout_s=60) as torch_transport:
            torch_transport.configure(num_stages=4, micro_count=8)
            yield torch_transport
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():
            await anyio.sleep(0.005)


def test_a_submitted_job_calls_back_on_the_loop() -> None:
    waiters = Waiters()
    work = FakeWork()
    calls: list[tuple[BaseException | None, int]] = []

    async def main() -> None:
        waiters.submit(
            [(work, False)], None, True, lambda e: calls.append((e, threading.get_ident()))
        )
        assert waiters.pending_sends == 1 and not calls
        work.finish()
        await _until(lambda: calls)

    anyio.run(main)
    assert calls == [(None, threading.get_ident())]  # on the loop's thread
    assert waiters.pending_sends == 0 and waiters.drain(5.0) == 0


def test_a_failed_job_calls_back_with_work_error() -> None:
    waiters = Waiters()
    work = FakeWork(error="Connection closed by peer")
    errors: list[BaseException | None] = []

    async def main() -> None:
        waiters.submit([(work, False)], None, False, errors.append)
        work.finish()
        await _until(lambda: errors)

    anyio.run(main)
    assert isinstance(errors[0], WorkError) and "Connection closed" in str(errors[0])


def test_a_cancelled_job_never_calls_back_and_its_send_stays_counted() -> None:
    waiters = Waiters()
    work = FakeWork()
    calls: list[BaseException | None] = []

    async def main() -> None:
        job = waiters.submit([(work, False)], None, True, calls.append)
        job.cancel()
        job.cancel()  # idempotent
        assert waiters.pending_sends == 1  # gloo still holds the send
        work.finish()
        await _until(lambda: waiters.pending_sends == 0)
        await anyio.sleep(0.02)

    anyio.run(main)
    assert calls == [] and waiters.drain(5.0) == 0


def test_close_fails_a_submitted_job_at_once_and_refuses_new_ones() -> None:
    waiters = Waiters()
    work = FakeWork()
    errors: list[BaseException | None] = []

    async def main() -> None:
        waiters.submit([(work, False)], None, False, errors.append)
        waiters.close()
        assert len(errors) == 1 and "closed while" in str(errors[0])
        with pytest.raises(RuntimeError, match="TorchDistTransport is closed"):
            waiters.submit([(FakeWork(), False)], None, False, errors.append)

    anyio.run(main)
    work.finish()
    assert waiters.drain(5.0) == 0 and len(errors) == 1


@pytest.mark.parametrize("size", [3, 5000])  # inside the header, and beyond it
def test_a_started_message_to_this_rank_arrives_in_either_order(
    transport: TorchDistTransport, size: int
) -> None:
    assert isinstance(transport, CallbackTransport) and transport.starts_messages
    payload = np.arange(size, dtype=np.float64)
    got: list[tuple[Array | None, BaseException | None]] = []
    sent: list[BaseException | None] = []

    async def main() -> None:
        key = MessageKey("F", 1, 0)
        transport.start_send(0, 0, key, payload, sent.append)  # sent first
        transport.start_recv(0, 0, key, lambda a, e: got.append((a, e)))
        key = MessageKey("B", 1, 0)
        transport.start_recv(0, 0, key, lambda a, e: got.append((a, e)))  # received first
        assert len(got) == 1
        transport.start_send(0, 0, key, payload, sent.append)

    anyio.run(main)
    assert sent == [None, None] and len(got) == 2
    for array, error in got:
        assert error is None and array is not None and array.tolist() == payload.tolist()
        assert not np.shares_memory(array, payload)
    stats = transport.stats()
    assert (stats.messages_sent, stats.messages_received, stats.bytes_sent) == (
        2,
        2,
        2 * payload.nbytes,
    )


def test_a_cancelled_started_receive_never_calls_back(transport: TorchDistTransport) -> None:
    key = MessageKey("F", 2, 1)
    calls: list[Any] = []

    async def main() -> None:
        handle = transport.start_recv(0, 0, key, lambda a, e: calls.append(a))
        with pytest.raises(RuntimeError, match="received twice"):
            transport.start_recv(0, 0, key, lambda a, e: None)
        handle.cancel()
        transport.start_send(0, 0, key, np.ones(2), lambda e: None)  # waits for a receive
        transport.start_recv(0, 0, key, lambda a, e: calls.append(("again", a)))

    anyio.run(main)
    assert len(calls) == 1 and calls[0][0] == "again" and calls[0][1].tolist() == [1.0, 1.0]


def test_close_fails_a_started_receive_and_refuses_new_starts(
    transport: TorchDistTransport,
) -> None:
    errors: list[BaseException | None] = []

    async def main() -> None:
        transport.start_recv(0, 0, MessageKey("B", 0, 0), lambda a, e: errors.append(e))
        started = time.monotonic()
        transport.close()
        assert time.monotonic() - started < 5
        with pytest.raises(RuntimeError, match="closed"):
            transport.start_send(0, 0, MessageKey("F", 1, 0), np.ones(1), errors.append)
        await asyncio.sleep(0)

    anyio.run(main)
    assert len(errors) == 1 and "closed" in str(errors[0])


def test_bad_starts_are_refused_by_name(transport: TorchDistTransport) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="src=1"):
            transport.start_send(1, 0, MessageKey("F", 1, 0), np.ones(1), lambda e: None)
        with pytest.raises(ValueError, match=r"key.micro=8 out of range"):
            transport.start_recv(0, 0, MessageKey("F", 1, 8), lambda a, e: None)

    anyio.run(main)
