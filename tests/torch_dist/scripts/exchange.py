"""Run under ``torchrun --nproc_per_node N`` (N >= 2): TorchDistTransport across processes.

1. Every rank exchanges arrays of many shapes and dtypes (empty, 0-d, odd shapes, not
   contiguous, below and above the 1 MiB inline limit) with every other rank, in both
   directions, started concurrently in shuffled orders with random delays, so messages
   arrive out of order; every payload is checked bit-exact.
2. ``all_gather`` and ``reduce_scatter_sum`` on the whole world, on a sub-group given in
   reversed order (one key in flight twice at once) and on this rank alone; each result
   is compared bit for bit with what ``InProcessTransport`` computes from the same
   contributions (all members simulated in this process).
3. A mismatched ``reduce_scatter_sum`` raises ValueError on every rank (no hang), and a
   message left unreceived in one epoch never reaches a receive of the next.
4. A second transport constructed with a different ``inline_max_bytes`` on each rank
   raises ValueError on every rank.

A rank that finds a mismatch prints it and aborts the job, so torchrun exits non-zero.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import traceback
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from ppswap.actors.p2p import InProcessTransport
from ppswap.backends.torch.distributed import TorchDistTransport
from ppswap.core.messages import MessageKey

Array = npt.NDArray[Any]
MICRO_COUNT = 16
CASES = 16


def payload(src: int, dst: int, index: int) -> Array:
    """The deterministic array that ``src`` sends to ``dst`` as case ``index``."""
    rng = np.random.default_rng([src, dst, index])
    cases: list[Array] = [
        rng.standard_normal((3, 5, 7)).astype(np.float32),
        np.array(rng.standard_normal(), dtype=np.float64),  # 0-d
        np.zeros((0, 5), dtype=np.int64),  # empty
        rng.integers(-(2**62), 2**62, size=(7, 1, 3)).astype(np.int64),
        rng.integers(0, 2, size=11).astype(np.bool_),
        rng.standard_normal((13, 3)).astype(np.float16),
        np.array([np.nan, -0.0, np.inf, 5e-324], dtype=np.float64) * (dst + 1),
        rng.integers(0, 60000, size=(6, 8)).astype(np.uint16)[::2, 1::3],  # not contiguous
        (rng.standard_normal((2, 3)) + 1j * rng.standard_normal((2, 3))).astype(np.complex64),
        np.array(["ab", "xyz", str(src)], dtype="<U3"),
        (np.arange(4) + src).astype("datetime64[ns]"),
        rng.standard_normal((129, 33)).astype(np.float32),  # 17028 bytes
        # above the 1 MiB inline limit: a second message of raw bytes
        rng.standard_normal((1 << 18) + 1).astype(np.float32),  # 4 bytes above
        rng.integers(0, 2, size=(1100, 1000)).astype(np.bool_)[:, ::-1],  # not contiguous
        rng.standard_normal((64, 64, 40)).astype(">f8"),  # big-endian
        rng.standard_normal(1 << 17).astype(np.float64),  # 1 MiB: the largest inline
    ]
    return cases[index % len(cases)]


def same_bits(got: Array, want: Array) -> bool:
    return bool(
        got.dtype == want.dtype
        and got.shape == want.shape
        and got.tobytes() == np.ascontiguousarray(want).tobytes()
    )


async def point_to_point(transport: TorchDistTransport) -> int:
    """Every rank sends CASES messages per direction to every other rank; returns #checked."""
    rank, size = transport.rank, transport.world_size
    rng = random.Random(rank)
    sends = [(p, d, i) for p in range(size) if p != rank for d in "FB" for i in range(CASES)]
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
        if not same_bits(got, payload(peer, rank, index)):
            raise AssertionError(f"rank {rank}: {direction}{index} from {peer}: {got!r}")
        checked += 1

    async with anyio.create_task_group() as tg:
        for peer, direction, index in sends:
            tg.start_soon(send, peer, direction, index, rng.random() * 0.02)
        for peer, direction, index in recvs:
            tg.start_soon(recv, peer, direction, index, rng.random() * 0.02)
    return checked


def contribution(member: int, target: int, call: int) -> Array:
    """float32 values over many magnitudes: the sum depends on the order of the fold."""
    rng = np.random.default_rng([member, target, call, 7])
    scale = np.float32(10.0) ** rng.integers(-4, 8, size=(5, 3)).astype(np.float32)
    return (rng.standard_normal((5, 3)) * scale).astype(np.float32)


async def reference(
    op: str, group: tuple[int, ...], key: str, inputs: dict[int, Any], rank: int
) -> Any:
    """What InProcessTransport returns to ``rank`` when every member passes ``inputs[m]``."""
    results: dict[int, Any] = {}
    local = InProcessTransport()

    async def member(m: int) -> None:
        call = local.all_gather if op == "all_gather" else local.reduce_scatter_sum
        results[m] = await call(m, group, key, inputs[m])

    async with anyio.create_task_group() as tg:
        for m in group:
            tg.start_soon(member, m)
    return results[rank]


async def collectives(transport: TorchDistTransport, group: tuple[int, ...]) -> int:
    """Both collectives on ``group``, checked against InProcessTransport; returns #checked."""
    rank = transport.rank
    gathered = await transport.all_gather(rank, group, "gather", np.full((rank + 1, 2), rank))
    inputs = {m: np.full((m + 1, 2), m) for m in group}
    want = await reference("all_gather", group, "gather", inputs, rank)
    if len(gathered) != len(group) or not all(map(same_bits, gathered, want)):
        raise AssertionError(f"rank {rank}: all_gather {group}: {gathered} != {want}")

    results: dict[int, Array] = {}

    async def reduce(call: int) -> None:
        arrays = [contribution(rank, target, call) for target in group]
        results[call] = await transport.reduce_scatter_sum(rank, group, "grads", arrays)

    async with anyio.create_task_group() as tg:  # the same key in flight twice
        tg.start_soon(reduce, 0)
        tg.start_soon(reduce, 1)
    for call, got in results.items():
        inputs = {m: [contribution(m, target, call) for target in group] for m in group}
        want = await reference("reduce_scatter_sum", group, "grads", inputs, rank)
        if not same_bits(got, want):
            raise AssertionError(f"rank {rank}: reduce_scatter_sum {group} call {call}")
        reverse = contribution(group[-1], rank, call).copy()
        for member in reversed(group[:-1]):
            reverse += contribution(member, rank, call)
        if len(group) > 2 and same_bits(reverse, want):
            raise AssertionError("the contributions do not tell the fold order apart")
    return 1 + len(results)


async def mismatched_reduce(transport: TorchDistTransport) -> None:
    """Rank 0 contributes another shape: every rank gets a ValueError, not a hang."""
    rank, world = transport.rank, tuple(range(transport.world_size))
    arrays = [np.ones(2 if rank == 0 else 3) for _ in world]
    try:
        await transport.reduce_scatter_sum(rank, world, "mismatch", arrays)
    except ValueError as error:
        if "expects" not in str(error):
            raise
    else:
        raise AssertionError(f"rank {rank}: mismatched reduce_scatter_sum did not fail")


async def stale_message(transport: TorchDistTransport) -> None:
    """Rank 1 sends a message rank 0 never receives; after ``configure`` (a new epoch) the
    same key carries another payload, and rank 0 must get that one."""
    rank, key = transport.rank, MessageKey("F", 0, 3)
    if rank == 1:
        with anyio.move_on_after(0.3):  # never received: the send stays posted in gloo
            await transport.send(1, 0, key, np.full(5000, 1.0))
    await transport.all_gather(rank, tuple(range(transport.world_size)), "barrier", np.ones(1))
    transport.configure(num_stages=transport.world_size, micro_count=MICRO_COUNT)
    if rank == 1:
        await transport.send(1, 0, key, np.full(5000, 2.0))
    elif rank == 0:
        got = await transport.recv(0, 1, key)
        if not same_bits(got, np.full(5000, 2.0)):
            raise AssertionError(f"rank 0 received the stale message: {got[:3]}")


async def main(transport: TorchDistTransport) -> None:
    transport.configure(num_stages=transport.world_size, micro_count=MICRO_COUNT)
    checked = await point_to_point(transport)
    world = tuple(range(transport.world_size))
    collective_checks = await collectives(transport, world)
    evens = tuple(r for r in reversed(world) if r % 2 == 0)
    if transport.rank in evens:
        collective_checks += await collectives(transport, evens)
    collective_checks += await collectives(transport, (transport.rank,))
    await mismatched_reduce(transport)
    # sends of payloads inside the header return at once and complete in the background:
    # every peer has received them by now (it joined the collectives after its receives)
    with anyio.fail_after(10):
        while transport.stats().undelivered:
            await anyio.sleep(0.01)
    stats = transport.stats()
    expected = 2 * CASES * (transport.world_size - 1)
    if (stats.messages_sent, stats.messages_received) != (expected, expected) or (
        checked != expected
    ):
        raise AssertionError(f"rank {transport.rank}: stats {stats}, checked {checked}")
    await stale_message(transport)
    print(
        f"rank {transport.rank} OK: {checked} messages bit-exact, "
        f"{collective_checks} collectives equal to InProcessTransport's",
        flush=True,
    )


def mismatched_inline_limit(rank: int) -> None:
    """Ranks that disagree on ``inline_max_bytes`` are refused when the transport is made."""
    try:
        TorchDistTransport(timeout_s=120, inline_max_bytes=1024 * (rank + 1))
    except ValueError as error:
        if "inline_max_bytes must be the same on every rank" not in str(error):
            raise
    else:
        raise AssertionError(f"rank {rank}: ranks disagreeing on inline_max_bytes were accepted")


def os_threads() -> list[str]:
    """The names of this process's threads, Python's and native ones, less gloo's TCP
    event loop: a peer's traffic the test leaves unreceived (``stale_message``) can keep
    that one until the process ends; it runs no Python. torch 2.13 names it
    ``gloo_tcp_loop``; torch 2.11 leaves it unnamed, so there it is the thread other than
    this one that sits in ``epoll_wait`` (it polls with a 10 ms timeout; gloo's worker
    threads and ppswap's waiting threads block on futexes)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as comm:
            name = comm.read().strip()
        if name == "gloo_tcp_loop" or (
            int(task) != threading.get_native_id() and _in_epoll_wait(task)
        ):
            continue
        names.append(name)
    return names


def _in_epoll_wait(task: str) -> bool:
    try:
        with open(f"/proc/self/task/{task}/wchan") as wchan:
            return wchan.read().strip() == "do_epoll_wait"
    except OSError:  # the thread ended meanwhile, or the kernel hides wchan
        return False


def check_nothing_left(before: list[str]) -> None:
    """A closed transport left no thread behind: its waiting threads are joined and its
    groups' gloo worker threads ended (none may end while the interpreter finalizes)."""
    waiting = [t.name for t in threading.enumerate() if t.name.startswith("ppswap-")]
    deadline = time.monotonic() + 5.0  # a joined thread leaves /proc a moment later
    while len(os_threads()) != len(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    if waiting or len(os_threads()) != len(before):
        raise AssertionError(
            f"after close: ppswap threads {waiting}, threads {os_threads()} against "
            f"{before} before the transport"
        )


if __name__ == "__main__":
    threads_before = os_threads()
    with TorchDistTransport(timeout_s=120) as torch_transport:
        try:
            anyio.run(main, torch_transport)
            mismatched_inline_limit(torch_transport.rank)
        except BaseException:
            print(f"rank {torch_transport.rank} FAILED", file=sys.stderr, flush=True)
            traceback.print_exc()
            torch_transport.abort(1)
    check_nothing_left(threads_before)
    print(f"rank {torch_transport.rank} closed: no thread left", flush=True)
