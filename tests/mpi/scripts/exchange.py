"""Run under ``mpiexec -n N`` (N >= 2): every rank exchanges arrays with every other rank.

Sends and receives of many shapes and dtypes are started concurrently in shuffled orders
with random delays, so messages arrive out of order; every payload is checked bit-exact.
Then ``all_gather`` and ``reduce_scatter_sum`` run on the whole world and on a sub-group
given in reversed order, with one key in flight twice at once. A rank that finds a
mismatch prints it and aborts the job, so the launcher exits non-zero instead of hanging.
"""

from __future__ import annotations

import random
import sys
import traceback
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from ppswap.core.messages import MessageKey
from ppswap.transports.mpi import MPITransport

Array = npt.NDArray[Any]
MICRO_COUNT = 16


def payload(src: int, dst: int, index: int) -> Array:
    """The deterministic array that ``src`` sends to ``dst`` as case ``index``."""
    rng = np.random.default_rng([src, dst, index])
    cases: list[Array] = [
        rng.standard_normal((3, 4)).astype(np.float32),
        np.array(rng.standard_normal(), dtype=np.float64),  # 0-d
        np.zeros((0, 5), dtype=np.int8),  # empty
        (rng.standard_normal((2, 3, 2)) + 1j * rng.standard_normal((2, 3, 2))).astype(
            np.complex128
        ),
        rng.integers(0, 2, size=7).astype(np.bool_),
        rng.integers(0, 60000, size=(6, 8)).astype(np.uint16)[::2, 1::3],  # not contiguous
        rng.standard_normal(1 << 19).astype(np.float16),  # 1 MiB: rendezvous path
        np.array(["ab", "xyz", str(src)], dtype="<U3"),
        rng.integers(-(2**31), 2**31 - 1, size=(2, 2, 2, 2)).astype(">i4"),  # big-endian
        (np.arange(4) + src).astype("datetime64[ns]"),
        np.array([np.nan, -0.0, np.inf], dtype=np.float64) * (dst + 1),
        # larger than the 16 KiB inline limit: a second message of raw bytes, for
        # dtypes that numpy exports no buffer for (datetime) or that mpi4py has no MPI
        # type for (big-endian, strings, bool)
        (np.arange(5000) * (src + 1)).astype("datetime64[us]"),
        rng.standard_normal((16, 32, 20)).astype(">f8"),
        np.array([f"r{src}-{i}" for i in range(3000)], dtype="<U8"),
        rng.integers(0, 2, size=(150, 150)).astype(np.bool_)[:, ::-1],  # not contiguous
    ]
    return cases[index % len(cases)]


CASES = 15


def same_bits(got: Array, want: Array) -> bool:
    return bool(
        got.dtype == want.dtype
        and got.shape == want.shape
        and got.tobytes() == np.ascontiguousarray(want).tobytes()
    )


async def point_to_point(transport: MPITransport) -> int:
    """Every rank sends CASES messages per direction to every other rank; returns #checked."""
    rank, size = transport.rank, transport.world_size
    rng = random.Random(rank)
    sends = [
        (peer, direction, index)
        for peer in range(size)
        if peer != rank
        for direction in "FB"
        for index in range(CASES)
    ]
    recvs = list(sends)
    rng.shuffle(sends)
    rng.shuffle(recvs)
    checked = 0

    async def send(peer: int, direction: str, index: int, delay: float) -> None:
        await anyio.sleep(delay)
        key = MessageKey(direction, rank, index)
        await transport.send(rank, peer, key, payload(rank, peer, index))

    async def recv(peer: int, direction: str, index: int, delay: float) -> None:
        nonlocal checked
        await anyio.sleep(delay)
        got = await transport.recv(rank, peer, MessageKey(direction, peer, index))
        want = payload(peer, rank, index)
        if not same_bits(got, want):
            raise AssertionError(f"rank {rank}: {direction}{index} from {peer}: {got!r}")
        checked += 1

    async with anyio.create_task_group() as tg:
        for peer, direction, index in sends:
            tg.start_soon(send, peer, direction, index, rng.random() * 0.02)
        for peer, direction, index in recvs:
            tg.start_soon(recv, peer, direction, index, rng.random() * 0.02)
    return checked


def contribution(member: int, target: int, call: int) -> Array:
    rng = np.random.default_rng([member, target, call, 7])
    return rng.standard_normal((5, 3))


async def collectives(transport: MPITransport, group: tuple[int, ...]) -> None:
    rank = transport.rank
    mine = np.full((rank + 1, 2), rank, dtype=np.int32)
    gathered = await transport.all_gather(rank, group, "gather", mine)
    for position, member in enumerate(group):
        want = np.full((member + 1, 2), member, dtype=np.int32)
        if not same_bits(gathered[position], want):
            raise AssertionError(f"rank {rank}: all_gather {group}[{position}]: {gathered}")

    results: dict[int, Array] = {}

    async def reduce(call: int) -> None:
        arrays = [contribution(rank, target, call) for target in group]
        results[call] = await transport.reduce_scatter_sum(rank, group, "grads", arrays)

    async with anyio.create_task_group() as tg:  # the same key in flight twice
        tg.start_soon(reduce, 0)
        tg.start_soon(reduce, 1)
    for call, got in results.items():
        want = contribution(group[0], rank, call).copy()
        for member in group[1:]:
            want += contribution(member, rank, call)
        if not same_bits(got, want):
            raise AssertionError(f"rank {rank}: reduce_scatter_sum {group} call {call}")


async def mismatched_reduce(transport: MPITransport) -> None:
    """Rank 0 contributes another shape: every rank gets a ValueError, not a hang."""
    rank, world = transport.rank, tuple(range(transport.world_size))
    length = 2 if rank == 0 else 3
    arrays = [np.ones(length) for _ in world]
    try:
        await transport.reduce_scatter_sum(rank, world, "mismatch", arrays)
    except ValueError as error:
        if "expects" not in str(error):
            raise
    else:
        raise AssertionError(f"rank {rank}: mismatched reduce_scatter_sum did not fail")


async def main(transport: MPITransport) -> None:
    transport.configure(num_stages=transport.world_size, micro_count=MICRO_COUNT)
    checked = await point_to_point(transport)
    world = tuple(range(transport.world_size))
    await collectives(transport, world)
    evens = tuple(r for r in reversed(world) if r % 2 == 0)
    if transport.rank in evens:
        await collectives(transport, evens)
    await collectives(transport, (transport.rank,))
    await mismatched_reduce(transport)
    stats = transport.stats()
    expected = 2 * CASES * (transport.world_size - 1)
    if (stats.messages_sent, stats.messages_received, stats.undelivered) != (
        expected,
        expected,
        0,
    ) or checked != expected:
        raise AssertionError(f"rank {transport.rank}: stats {stats}, checked {checked}")
    print(f"rank {transport.rank} OK: {checked} messages bit-exact", flush=True)


if __name__ == "__main__":
    with MPITransport() as mpi_transport:
        try:
            anyio.run(main, mpi_transport)
        except BaseException:
            print(f"rank {mpi_transport.rank} FAILED", file=sys.stderr, flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            mpi_transport.abort(1)
