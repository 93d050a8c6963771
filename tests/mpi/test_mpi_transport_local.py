"""MPITransport inside this one process (an MPI singleton: world size 1, self-messages).

What needs no second process is checked here: the wire format for many shapes and dtypes,
input validation, epochs, cancellation, ``close()`` and the receive-buffer pool. The
multi-process behaviour is in ``test_mpi_transport.py``.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("mpi4py")
from mpi4py import MPI

from ppswap.core.dtypes import BFLOAT16
from ppswap.core.messages import MessageKey
from ppswap.core.wire import PAGE_BYTES, POOL_MIN_BYTES, RecvBufferPool
from ppswap.results import RankStats
from ppswap.transports.distributed import gather_results
from ppswap.transports.mpi import MPITransport

Array = npt.NDArray[Any]


@pytest.fixture
def transport() -> Iterator[MPITransport]:
    with MPITransport(poll_interval_s=1e-3, spin_s=1e-4) as mpi_transport:
        mpi_transport.configure(num_stages=4, micro_count=8)
        yield mpi_transport


def run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    return anyio.run(fn, *args)


async def self_exchange(transport: MPITransport, key: MessageKey, payload: Array) -> Array:
    """Send ``payload`` to this rank and receive it back (concurrently, as MPI requires)."""
    received: list[Array] = []

    async def receive() -> None:
        received.append(await transport.recv(0, 0, key))

    async with anyio.create_task_group() as tg:
        tg.start_soon(receive)
        await transport.send(0, 0, key, payload)
    return received[0]


PAYLOADS = {
    "float32": np.arange(12, dtype=np.float32).reshape(3, 4),
    "0-d": np.array(3.25),
    "empty": np.zeros((0, 5), dtype=np.int8),
    "complex": (np.arange(6) * (1 + 2j)).reshape(3, 2),
    "bool": np.array([True, False, True]),
    "strided": np.arange(48, dtype=np.uint16).reshape(6, 8)[::2, 1::3],
    "big-endian": np.arange(5, dtype=">i4"),
    "strings": np.array(["a", "bcd"]),
    "datetime": np.arange(3).astype("datetime64[ms]"),
    "nan": np.array([np.nan, -0.0, np.inf]),
    "inline-limit": np.arange(16 * 1024, dtype=np.uint8),  # largest inline payload
    "above-inline": np.arange(16 * 1024 + 1, dtype=np.uint8),  # header + body messages
    "large": np.arange(1 << 19, dtype=np.float64),  # 4 MiB: pooled receive buffer
    # ml_dtypes' bfloat16 (dtype.str "<V2" does not name it: the header says "bfloat16")
    "bfloat16": np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4).astype(BFLOAT16),
    "bfloat16 above-inline": np.linspace(-1, 1, 8 * 1024 + 1).astype(BFLOAT16),
}


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_round_trip_is_bit_exact(transport: MPITransport, name: str) -> None:
    payload = PAYLOADS[name]
    got = run(self_exchange, transport, MessageKey("F", 1, 2), payload)
    assert got.dtype == payload.dtype
    assert got.shape == payload.shape
    assert got.tobytes() == np.ascontiguousarray(payload).tobytes()
    assert got.flags.c_contiguous and got.flags.writeable
    assert not np.shares_memory(got, payload)
    stats = transport.stats()
    assert (stats.messages_sent, stats.messages_received, stats.undelivered) == (1, 1, 0)
    assert stats.bytes_sent == payload.nbytes


def test_mindspores_numpy_bfloat16_arrives_as_ml_dtypes_bfloat16(transport: MPITransport) -> None:
    """MindSpore's numpy bfloat16 (a type of its own, which the header cannot name) is sent
    as ml_dtypes' (the same bytes); MindSpore's ``Tensor.from_numpy`` reads that one."""
    ms = pytest.importorskip("mindspore")
    values = np.linspace(-3, 3, 4 * 1024 + 1, dtype=np.float32)  # above the inline limit
    theirs = ms.Tensor(values).astype(ms.bfloat16).asnumpy()
    assert theirs.dtype != BFLOAT16
    got = run(self_exchange, transport, MessageKey("F", 1, 2), theirs)
    assert got.dtype == BFLOAT16 and got.tobytes() == theirs.tobytes()
    back = ms.Tensor.from_numpy(got)
    assert back.dtype == ms.bfloat16
    assert np.array_equal(back.astype(ms.float32).asnumpy(), got.astype(np.float32))


def test_messages_with_distinct_keys_are_never_confused(transport: MPITransport) -> None:
    keys = [MessageKey(d, s, m) for d in "FB" for s in range(4) for m in range(8)]

    async def main() -> dict[MessageKey, Array]:
        got: dict[MessageKey, Array] = {}

        async def receive(key: MessageKey) -> None:
            got[key] = await transport.recv(0, 0, key)

        async with anyio.create_task_group() as tg:
            for key in reversed(keys):
                tg.start_soon(receive, key)
            for key in keys:
                tg.start_soon(transport.send, 0, 0, key, np.array([key.stage, key.micro]))
        return got

    got = run(main)
    assert {key: tuple(value) for key, value in got.items()} == {
        key: (key.stage, key.micro) for key in keys
    }


def test_waiting_receive_does_not_block_the_event_loop(transport: MPITransport) -> None:
    key = MessageKey("B", 0, 1)

    async def main() -> tuple[int, Array]:
        ticks = 0
        received: list[Array] = []

        async def receive() -> None:
            received.append(await transport.recv(0, 0, key))

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            for _ in range(20):  # the receive is pending all along
                await anyio.sleep(0.005)
                ticks += 1
            await transport.send(0, 0, key, np.ones(3))
        return ticks, received[0]

    ticks, got = run(main)
    assert ticks == 20
    assert got.tolist() == [1.0, 1.0, 1.0]


def test_a_message_from_an_earlier_run_never_reaches_a_later_one(
    transport: MPITransport,
) -> None:
    """Each epoch has its own tags: neither the stale header nor its body can match."""
    key = MessageKey("F", 2, 3)
    stale = np.full(8192, 1.0)  # 64 KiB: header and body travel as two messages
    fresh = np.full(8192, 2.0)

    async def main() -> Array:
        async with anyio.create_task_group() as tg:
            tg.start_soon(transport.send, 0, 0, key, stale)
            await anyio.sleep(0.05)  # the stale message waits in MPI's queue
            transport.configure(num_stages=4, micro_count=8)  # a new run starts
            tg.start_soon(transport.send, 0, 0, key, fresh)
            with anyio.fail_after(5):
                got = await transport.recv(0, 0, key)
            tg.cancel_scope.cancel()  # the stale send is never received
        return got

    got = run(main)
    assert np.array_equal(got, fresh)


def test_a_stale_message_is_an_error_when_the_tag_space_has_room_for_one_epoch() -> None:
    with MPITransport(spin_s=1e-4) as mpi_transport:
        tag_space = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) + 1
        micro_count = tag_space // (4 * 2048)  # the layout fills the tag space
        mpi_transport.configure(num_stages=2048, micro_count=micro_count)
        key = MessageKey("F", 2, 3)

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(mpi_transport.send, 0, 0, key, np.ones(2))
                await anyio.sleep(0.05)  # the message is delivered into MPI's queue
                mpi_transport.configure(num_stages=2048, micro_count=micro_count)
                with pytest.raises(RuntimeError, match="stale"):
                    await mpi_transport.recv(0, 0, key)
                tg.cancel_scope.cancel()

        run(main)


def test_cancelled_receive_is_cancelled_in_mpi(transport: MPITransport) -> None:
    async def main() -> None:
        with anyio.move_on_after(0.05) as scope:
            await transport.recv(0, 0, MessageKey("F", 0, 0))
        assert scope.cancelled_caught

    run(main)
    assert transport.stats().undelivered == 0
    # the cancelled receive must not swallow the next message with the same key
    got = run(self_exchange, transport, MessageKey("F", 0, 0), np.arange(3))
    assert got.tolist() == [0, 1, 2]


def test_close_cancels_pending_requests_and_fails_waiters() -> None:
    mpi_transport = MPITransport(spin_s=0.0)
    mpi_transport.configure(num_stages=2, micro_count=2)
    errors: list[BaseException] = []

    async def main() -> None:
        async def receive() -> None:
            try:
                await mpi_transport.recv(0, 0, MessageKey("B", 1, 1))
            except RuntimeError as error:
                errors.append(error)

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            # a large self-send stays pending (rendezvous) until a receive matches it
            tg.start_soon(receive_nothing_send_large, mpi_transport)
            await anyio.sleep(0.05)
            assert mpi_transport.stats().undelivered == 1
            mpi_transport.close()

    run(main)
    assert mpi_transport.closed
    assert len(errors) == 1 and "closed" in str(errors[0])
    mpi_transport.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        run(mpi_transport.send, 0, 0, MessageKey("F", 1, 0), np.ones(1))


async def receive_nothing_send_large(mpi_transport: MPITransport) -> None:
    with pytest.raises(RuntimeError, match="closed"):
        await mpi_transport.send(0, 0, MessageKey("F", 1, 1), np.ones(1 << 20))


def test_single_member_collectives(transport: MPITransport) -> None:
    array = np.arange(6.0).reshape(2, 3)
    gathered = run(transport.all_gather, 0, (0,), "w", array)
    assert len(gathered) == 1 and gathered[0] is array
    summed = run(transport.reduce_scatter_sum, 0, (0,), "g", [array])
    assert summed.tolist() == array.tolist() and summed is not array


def test_recv_buffer_pool_recycles_only_unreferenced_blocks() -> None:
    size = 4 << 20
    block_bytes = size + PAGE_BYTES  # each block has a page to spare for the alignment
    pool = RecvBufferPool(capacity_bytes=2 * block_bytes)
    first = pool.take(size)
    address = first.ctypes.data
    view = first.view(np.float64)[3:]
    del first
    gc.collect()
    second = pool.take(size)
    assert second.ctypes.data != address  # ``view`` still uses the first block
    del view
    third = pool.take(size)
    assert third.ctypes.data == address  # recycled
    assert pool.held_bytes == 2 * block_bytes
    overflow = pool.take(size)  # both blocks in use and the pool is full
    assert overflow.nbytes == size and pool.held_bytes == 2 * block_bytes
    del second, third, overflow
    assert pool.take(size).ctypes.data == address  # free again once nothing refers to it
    roomy = RecvBufferPool(capacity_bytes=4 * block_bytes)
    assert roomy.take(POOL_MIN_BYTES).base is not None  # pooled from the threshold up
    small = roomy.take(POOL_MIN_BYTES - 1)
    assert small.base is None  # below the pooling threshold: a plain allocation
    disabled = RecvBufferPool(capacity_bytes=0)
    assert disabled.take(size).base is None


@pytest.mark.parametrize("page_offset", [0, 16, 48, 1040, PAGE_BYTES - 16])
def test_recv_buffer_pool_places_buffers_at_the_requested_page_offset(page_offset: int) -> None:
    size = 1 << 20
    pool = RecvBufferPool(capacity_bytes=size + PAGE_BYTES)  # room for one block
    fresh = pool.take(size, page_offset)
    assert fresh.ctypes.data % PAGE_BYTES == page_offset and fresh.nbytes == size
    address = fresh.ctypes.data
    del fresh
    other_offset = (page_offset + 80) % PAGE_BYTES
    recycled = pool.take(size, other_offset)  # the same block, another start in it
    assert recycled.ctypes.data % PAGE_BYTES == other_offset
    assert abs(recycled.ctypes.data - address) < PAGE_BYTES
    overflow = pool.take(size, page_offset)  # the pool is full: aligned all the same
    assert overflow.ctypes.data % PAGE_BYTES == page_offset


@pytest.mark.parametrize("page_offset", [0, 16, 1040])
def test_a_received_body_lies_in_its_page_as_the_sent_one(
    transport: MPITransport, page_offset: int
) -> None:
    """A single-copy transfer runs 4-8x slower into a destination 8 or 16 bytes further into
    its page than the source (``benchmarks/bench_cma_alignment.py``), so the receiver
    matches the sender's page offset."""
    arena = np.random.default_rng(page_offset).standard_normal(2 * PAGE_BYTES + (1 << 17))
    raw = arena.view(np.uint8)
    start = (page_offset - raw.ctypes.data) % PAGE_BYTES
    sent = raw[start : start + (1 << 20)].view(np.float32)
    assert sent.ctypes.data % PAGE_BYTES == page_offset
    got = run(self_exchange, transport, MessageKey("B", 1, 2), sent)
    assert got.ctypes.data % PAGE_BYTES == page_offset
    assert got.tobytes() == sent.tobytes()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda t: t.send(1, 0, MessageKey("F", 1, 0), np.ones(1)), ValueError, "src=1"),
        (lambda t: t.send(0, 5, MessageKey("F", 1, 0), np.ones(1)), ValueError, "dst=5"),
        (lambda t: t.send(0, 0, MessageKey("F", 1, 0), [1.0]), TypeError, "numpy.ndarray"),
        (
            lambda t: t.send(0, 0, MessageKey("F", 1, 0), np.array([object()])),
            TypeError,
            "dtype",
        ),
        (
            lambda t: t.send(0, 0, MessageKey("F", 1, 0), np.zeros(2, dtype="i4,f8")),
            TypeError,
            "structured",
        ),
        (lambda t: t.recv(0, 0, MessageKey("X", 1, 0)), ValueError, "direction"),
        (lambda t: t.recv(0, 0, ["F", 1, 0]), TypeError, "MessageKey"),
        (lambda t: t.recv(0, 0, MessageKey("F", 4, 0)), ValueError, "key.stage=4"),
        (lambda t: t.recv(0, 0, MessageKey("F", 1, 8)), ValueError, "key.micro=8"),
        (lambda t: t.recv(1, 0, MessageKey("F", 1, 0)), ValueError, "dst=1"),
        (lambda t: t.recv(0, True, MessageKey("F", 1, 0)), TypeError, "src"),
        (lambda t: t.all_gather(0, [0], "k", np.ones(1)), TypeError, "group"),
        (lambda t: t.all_gather(2, (0,), "k", np.ones(1)), ValueError, "rank=2"),
        (lambda t: t.all_gather(0, (0, 0), "k", np.ones(1)), ValueError, "distinct"),
        (lambda t: t.all_gather(0, (3,), "k", np.ones(1)), ValueError, "group member=3"),
        (lambda t: t.all_gather(0, (0,), 7, np.ones(1)), TypeError, "key"),
        (lambda t: t.reduce_scatter_sum(0, (0,), "k", []), ValueError, "1, one per member"),
        (lambda t: t.reduce_scatter_sum(0, (0,), "k", np.ones(1)), TypeError, "list"),
    ],
)
def test_bad_input_names_the_parameter(
    transport: MPITransport,
    call: Callable[[MPITransport], Awaitable[Any]],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        run(lambda: call(transport))


def test_configure_rejects_layouts_beyond_the_tag_space(transport: MPITransport) -> None:
    with pytest.raises(ValueError, match="MPI tags"):
        transport.configure(num_stages=1 << 14, micro_count=1 << 14)
    with pytest.raises(ValueError, match="num_stages=0"):
        transport.configure(num_stages=0, micro_count=4)
    with pytest.raises(TypeError, match="micro_count"):
        transport.configure(num_stages=2, micro_count=4.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"poll_interval_s": -1.0}, "poll_interval_s"),
        ({"spin_s": math.inf}, "spin_s"),
        ({"busy_poll_s": -1e-6}, "busy_poll_s"),
        ({"busy_poll_s": "fast"}, "busy_poll_s"),
        ({"recv_pool_bytes": -1}, "recv_pool_bytes"),
        ({"comm": "world"}, "comm"),
    ],
)
def test_constructor_rejects_bad_settings(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        MPITransport(**kwargs)


def test_rank_and_world_size_of_a_singleton() -> None:
    with MPITransport() as mpi_transport:
        assert (mpi_transport.rank, mpi_transport.world_size) == (0, 1)


def test_gather_results_round_trips_rank_stats_with_job_maps(transport: MPITransport) -> None:
    stats = RankStats(
        rank=0,
        peak_saved_bytes=123,
        offloaded_bytes=45,
        loaded_bytes=45,
        exposed_copy_wait_s=0.25,
        steps_executed=7,
        copies=2,
        copy_busy_s=0.5,
        compute_job_s={"forward": 0.125, "backward": 0.75},
        compute_jobs={"forward": 3, "backward": 4},
    )
    losses, everyone = run(gather_results, transport, stats, [1.5, 2.5], 2)
    assert losses == [1.5, 2.5]
    assert everyone == [stats]
    assert type(everyone[0].compute_jobs["forward"]) is int
    assert type(everyone[0].steps_executed) is int
