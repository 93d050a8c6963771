"""MPITransport's callback side (``CallbackTransport``) in one process (an MPI singleton).

``start_send`` / ``start_recv`` with self-messages: bit-exact round trips inside and
beyond the header, many receives completed by the one poller, a waiting receive that
leaves the loop free, cancellation (cancelled in MPI, no callback), ``close()`` failing
what was started, a stale header reported through the callback, and ``complete_all``.
Between processes this path serves the pipelines of ``test_mpi_runtime.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("mpi4py")
from mpi4py import MPI

from ppswap.core.messages import MessageKey
from ppswap.core.transport import CallbackTransport, complete_all
from ppswap.transports.mpi import MPITransport

Array = npt.NDArray[Any]
Got = list[tuple[Array | None, BaseException | None]]


@pytest.fixture
def transport() -> Iterator[MPITransport]:
    with MPITransport(poll_interval_s=1e-3, spin_s=1e-4) as mpi_transport:
        mpi_transport.configure(num_stages=4, micro_count=8)
        yield mpi_transport


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():
            await anyio.sleep(0.001)


@pytest.mark.parametrize("size", [3, 16 * 1024 // 8 + 1, 1 << 19])  # inline, body, pooled
@pytest.mark.parametrize("receive_first", [False, True])
def test_a_started_round_trip_is_bit_exact(
    transport: MPITransport, size: int, receive_first: bool
) -> None:
    assert isinstance(transport, CallbackTransport) and transport.starts_messages
    payload = np.linspace(-1, 1, size)
    got: Got = []
    sent: list[BaseException | None] = []
    key = MessageKey("F", 1, 2)

    async def main() -> None:
        if receive_first:
            transport.start_recv(0, 0, key, lambda a, e: got.append((a, e)))
        transport.start_send(0, 0, key, payload, sent.append)
        if not receive_first:
            transport.start_recv(0, 0, key, lambda a, e: got.append((a, e)))
        await _until(lambda: got and sent)

    anyio.run(main)
    assert sent == [None] and len(got) == 1
    array, error = got[0]
    assert error is None and array is not None
    assert array.tobytes() == payload.tobytes() and not np.shares_memory(array, payload)
    stats = transport.stats()
    assert (stats.messages_sent, stats.messages_received, stats.undelivered) == (1, 1, 0)


def test_many_started_receives_complete_with_their_own_payloads(transport: MPITransport) -> None:
    keys = [MessageKey(d, s, m) for d in "FB" for s in range(4) for m in range(8)]
    got: dict[MessageKey, Array | None] = {}

    async def main() -> None:
        for key in reversed(keys):
            transport.start_recv(0, 0, key, lambda a, e, key=key: got.__setitem__(key, a))
        for key in keys:
            transport.start_send(0, 0, key, np.array([key.stage, key.micro]), lambda e: None)
        await _until(lambda: len(got) == len(keys))

    anyio.run(main)
    assert {k: tuple(v) for k, v in got.items() if v is not None} == {
        k: (k.stage, k.micro) for k in keys
    }


def test_a_waiting_started_receive_leaves_the_loop_free(transport: MPITransport) -> None:
    got: Got = []

    async def main() -> int:
        transport.start_recv(0, 0, MessageKey("B", 0, 1), lambda a, e: got.append((a, e)))
        ticks = 0
        for _ in range(20):  # the receive is pending all along
            await anyio.sleep(0.005)
            ticks += 1
        transport.start_send(0, 0, MessageKey("B", 0, 1), np.ones(3), lambda e: None)
        await _until(lambda: got)
        return ticks

    assert anyio.run(main) == 20
    assert got[0][1] is None and got[0][0] is not None and got[0][0].tolist() == [1.0] * 3


def test_a_cancelled_started_receive_is_cancelled_in_mpi(transport: MPITransport) -> None:
    key = MessageKey("F", 0, 0)
    calls: list[Any] = []

    async def main() -> None:
        handle = transport.start_recv(0, 0, key, lambda a, e: calls.append("cancelled one"))
        await anyio.sleep(0.01)
        handle.cancel()
        handle.cancel()  # idempotent
        # the cancelled receive must not swallow the next message with the same key
        transport.start_recv(0, 0, key, lambda a, e: calls.append(a))
        transport.start_send(0, 0, key, np.arange(3), lambda e: None)
        await _until(lambda: calls)
        await anyio.sleep(0.01)

    anyio.run(main)
    assert len(calls) == 1 and calls[0].tolist() == [0, 1, 2]


def test_close_fails_what_was_started_and_refuses_new_starts() -> None:
    mpi_transport = MPITransport(spin_s=0.0)
    mpi_transport.configure(num_stages=2, micro_count=2)
    errors: list[BaseException | None] = []

    async def main() -> None:
        mpi_transport.start_recv(0, 0, MessageKey("B", 1, 1), lambda a, e: errors.append(e))
        # a large self-send stays pending (rendezvous) until a receive matches it
        mpi_transport.start_send(0, 0, MessageKey("F", 1, 1), np.ones(1 << 20), errors.append)
        await anyio.sleep(0.02)
        assert mpi_transport.stats().undelivered == 1
        mpi_transport.close()
        with pytest.raises(RuntimeError, match="closed"):
            mpi_transport.start_send(0, 0, MessageKey("F", 1, 0), np.ones(1), errors.append)
        await asyncio.sleep(0.01)

    anyio.run(main)
    assert len(errors) == 2 and all("closed" in str(error) for error in errors)


def test_a_stale_header_is_reported_through_the_callback() -> None:
    with MPITransport(spin_s=1e-4) as mpi_transport:
        tag_space = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) + 1
        micro_count = tag_space // (4 * 2048)  # the layout fills the tag space: one epoch
        mpi_transport.configure(num_stages=2048, micro_count=micro_count)
        key = MessageKey("F", 2, 3)
        got: Got = []

        async def main() -> None:
            mpi_transport.start_send(0, 0, key, np.ones(2), lambda e: None)
            await anyio.sleep(0.02)  # delivered into MPI's queue
            mpi_transport.configure(num_stages=2048, micro_count=micro_count)
            mpi_transport.start_recv(0, 0, key, lambda a, e: got.append((a, e)))
            await _until(lambda: got)

        anyio.run(main)
        assert got[0][0] is None and "stale" in str(got[0][1])


def test_complete_all_returns_in_order_and_cancels_the_rest_on_a_failure(
    transport: MPITransport,
) -> None:
    def send(key: MessageKey, value: float) -> Any:
        return lambda done: transport.start_send(0, 0, key, np.full(2, value), done)

    def recv(key: MessageKey) -> Any:
        return lambda done: transport.start_recv(0, 0, key, done)

    a, b, never = MessageKey("F", 0, 1), MessageKey("F", 0, 2), MessageKey("F", 0, 3)

    async def main() -> list[Any]:
        results = await complete_all([recv(b), send(a, 1.0), recv(a), send(b, 2.0)])

        def refused(done: Any) -> Any:
            raise ValueError("refused")

        with pytest.raises(ValueError, match="refused"):  # the receive started is cancelled
            await complete_all([recv(never), refused])
        with anyio.move_on_after(0.05) as scope:  # cancelled: so is what it started
            await complete_all([recv(never)])
        assert scope.cancelled_caught
        assert await complete_all([]) == []
        return results

    got_b, none_a, got_a, none_b = anyio.run(main)
    assert none_a is None and none_b is None
    assert got_a.tolist() == [1.0, 1.0] and got_b.tolist() == [2.0, 2.0]
    # nothing of the cancelled receives is left: the next message on their key arrives
    got = anyio.run(complete_all, [recv(never), send(never, 3.0)])
    assert got[0].tolist() == [3.0, 3.0]
