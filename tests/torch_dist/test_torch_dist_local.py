"""TorchDistTransport inside this one process (a gloo group of world size 1).

What needs no second process: the protocols, the payload helpers and the header in a
receive buffer larger than the message (as gloo delivers it), the tag layout and epochs,
messages to this rank itself, collectives of one member, validation, ``close()``, and the
waiting threads (with stand-in works). The multi-process behaviour is in
``test_torch_dist_transport.py``.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("torch")
import torch
import torch.distributed as dist
from fake_work import FakeWork

from ppswap.backends.torch.distributed import P2P_TAGS, TorchDistTransport
from ppswap.backends.torch.distributed_io import DEFAULT_INLINE_MAX_BYTES, MessageIO
from ppswap.backends.torch.distributed_wait import Waiters, WorkError, host_tensor
from ppswap.core.dtypes import BFLOAT16
from ppswap.core.messages import MessageKey
from ppswap.core.transport import CollectiveTransport, DistributedTransport, Transport
from ppswap.core.wire import HEADER_MAX_BYTES, INLINE_MAX_BYTES, decode_header, encode_message
from ppswap.results import RankStats
from ppswap.transports.distributed import AbortingTransport, gather_results, is_distributed

Array = npt.NDArray[Any]

PAYLOADS = {
    "float32": np.arange(12, dtype=np.float32).reshape(3, 4),
    "float64 0-d": np.array(3.25),
    "int64 empty": np.zeros((0, 5), dtype=np.int64),
    "bool": np.array([True, False, True]),
    "float16 odd": np.arange(35, dtype=np.float16).reshape(5, 7),
    "big-endian": np.arange(6, dtype=">i4").reshape(2, 3),
    "datetime": np.arange(3).astype("datetime64[ns]"),
    "strings": np.array(["ab", "xyz"], dtype="<U3"),
    "not contiguous": np.arange(40, dtype=np.int64).reshape(5, 8)[:, ::3],
    "above MPI's inline limit": np.linspace(-1, 1, INLINE_MAX_BYTES // 4 + 1, dtype=np.float32),
    "above the torch inline limit": np.linspace(
        -1, 1, DEFAULT_INLINE_MAX_BYTES // 4 + 1, dtype=np.float32
    ),
    # ml_dtypes' bfloat16, which a bfloat16 model's activations travel as
    "bfloat16 not contiguous": np.linspace(-3, 3, 40).reshape(5, 8)[:, ::3].astype(BFLOAT16),
    "bfloat16 above the torch inline limit": np.linspace(
        -1, 1, DEFAULT_INLINE_MAX_BYTES // 2 + 1
    ).astype(BFLOAT16),
}


def same_bits(got: Array, want: Array) -> bool:
    return bool(
        got.dtype == want.dtype
        and got.shape == want.shape
        and got.tobytes() == np.ascontiguousarray(want).tobytes()
    )


@pytest.fixture
def world_of_one() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def transport(world_of_one: None) -> Iterator[TorchDistTransport]:
    with TorchDistTransport(timeout_s=60) as torch_transport:
        torch_transport.configure(num_stages=4, micro_count=8)
        yield torch_transport


# -- payload helpers and the header ----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_host_tensor_is_the_arrays_bytes_without_a_copy(name: str) -> None:
    array = np.ascontiguousarray(PAYLOADS[name])
    tensor = host_tensor(array)
    assert tensor.dtype == torch.uint8 and tensor.numel() == array.nbytes
    assert tensor.numpy().tobytes() == array.tobytes()
    if array.nbytes:
        assert tensor.data_ptr() == array.ctypes.data


def test_host_tensor_of_a_read_only_array_warns_nothing() -> None:
    array = np.arange(5.0)
    array.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_tensor(array).numpy().tobytes() == array.tobytes()


@pytest.mark.parametrize("limit", [INLINE_MAX_BYTES, DEFAULT_INLINE_MAX_BYTES])
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_a_header_in_a_larger_buffer_decodes_to_the_same_array(name: str, limit: int) -> None:
    body = np.ascontiguousarray(PAYLOADS[name])
    message = encode_message(5, 42, body, inline_max_bytes=limit)
    received = bytearray(b"\xff" * (HEADER_MAX_BYTES + limit))  # as gloo fills it
    torch.frombuffer(received, dtype=torch.uint8)[: len(message)].copy_(
        torch.frombuffer(message, dtype=torch.uint8)
    )
    nbytes, dtype, shape, size, _ = decode_header(received, 5, 42, ("recv", name))
    assert (nbytes, dtype, shape) == (body.nbytes, body.dtype, body.shape)
    inlined = len(message) > size
    assert inlined == (0 < body.nbytes <= limit)
    if inlined:
        raw = np.frombuffer(received[size : size + nbytes], dtype=np.uint8)
        assert same_bits(np.ndarray(shape, dtype, raw), body)
    with pytest.raises(RuntimeError, match=f"recv {name}: the header belongs to another"):
        decode_header(received, 6, 42, ("recv", name))


# -- the transport in one process ------------------------------------------------------------


def test_it_is_a_distributed_collective_transport(transport: TorchDistTransport) -> None:
    assert isinstance(transport, Transport)
    assert isinstance(transport, CollectiveTransport)
    assert isinstance(transport, DistributedTransport) and is_distributed(transport)
    assert isinstance(transport, AbortingTransport)  # the runtime's abort_job ends the job
    assert (transport.rank, transport.world_size, transport.abort_on_failure) == (0, 1, True)


def test_p2p_tags_are_distinct_and_consecutive_epochs_disjoint(
    transport: TorchDistTransport,
) -> None:
    keys = [MessageKey(d, s, m) for d in "FB" for s in range(4) for m in range(8)]
    first = [transport._tags.address(key)[0] for key in keys]
    transport.configure(num_stages=4, micro_count=8)
    second = [transport._tags.address(key)[0] for key in keys]
    for tags in (first, second):
        assert len(set(tags)) == len(keys)
        assert all(tag % 2 == 0 and 0 <= tag < P2P_TAGS for tag in tags)
    bodies = {tag + 1 for tag in first}
    assert not (set(first) | bodies) & set(second)


def test_a_layout_too_large_for_the_tags_is_refused(transport: TorchDistTransport) -> None:
    with pytest.raises(ValueError, match="num_stages=1024 and micro_count=524288 need"):
        transport.configure(num_stages=1024, micro_count=1 << 19)
    with pytest.raises(ValueError, match=r"key.micro=8 out of range"):
        anyio.run(transport.send, 0, 0, MessageKey("F", 1, 8), np.ones(2))


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_a_message_to_this_rank_arrives_bit_exact_in_either_order(
    transport: TorchDistTransport, name: str
) -> None:
    payload = PAYLOADS[name]

    async def main() -> tuple[Array, Array]:
        await transport.send(0, 0, MessageKey("F", 1, 0), payload)  # sent first
        early = await transport.recv(0, 0, MessageKey("F", 1, 0))
        got: list[Array] = []

        async def receive() -> None:
            got.append(await transport.recv(0, 0, MessageKey("B", 1, 0)))

        async with anyio.create_task_group() as tg:  # received first
            tg.start_soon(receive)
            await anyio.sleep(0.01)
            await transport.send(0, 0, MessageKey("B", 1, 0), payload)
        return early, got[0]

    early, late = anyio.run(main)
    assert same_bits(early, payload) and same_bits(late, payload)
    assert transport.stats() == transport.stats().__class__(2, 2, 2 * payload.nbytes, 0)


def test_a_message_to_this_rank_is_a_copy(transport: TorchDistTransport) -> None:
    payload = np.arange(4.0)

    async def main() -> Array:
        await transport.send(0, 0, MessageKey("F", 0, 1), payload)
        payload[:] = -1  # the buffer may be reused once send returned
        return await transport.recv(0, 0, MessageKey("F", 0, 1))

    assert same_bits(anyio.run(main), np.arange(4.0))


def test_collectives_of_one_member(transport: TorchDistTransport) -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)

    async def main() -> tuple[list[Array], Array]:
        gathered = await transport.all_gather(0, (0,), "w", array)
        total = await transport.reduce_scatter_sum(0, (0,), "g", [array])
        return gathered, total

    gathered, total = anyio.run(main)
    assert len(gathered) == 1 and gathered[0] is array
    assert same_bits(total, array) and total is not array


def test_gather_results_runs_over_it(transport: TorchDistTransport) -> None:
    stats = RankStats(0, 7, 0, 0, 0.25, 12, 3, 0.5, compute_job_s={"forward": 0.125})
    losses, everyone = anyio.run(gather_results, transport, stats, [0.5, 0.25], 2)
    assert losses == [0.5, 0.25] and everyone == [stats]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda t: t.send(1, 0, MessageKey("F", 0, 0), np.ones(1)), ValueError, "src=1"),
        (lambda t: t.send(0, 1, MessageKey("F", 0, 0), np.ones(1)), ValueError, "dst=1"),
        (lambda t: t.recv(0, -1, MessageKey("F", 0, 0)), ValueError, "src=-1"),
        (lambda t: t.recv(0, 0, ("F", 0, 0)), TypeError, "key must be a MessageKey"),
        (lambda t: t.send(0, 0, MessageKey("X", 0, 0), np.ones(1)), ValueError, "'F' or 'B'"),
        (lambda t: t.send(0, 0, MessageKey("F", 0, 0), [1.0]), TypeError, "numpy.ndarray"),
        (lambda t: t.all_gather(0, (0, 0), "k", np.ones(1)), ValueError, "distinct ranks"),
        (lambda t: t.all_gather(0, (1,), "k", np.ones(1)), ValueError, "group member=1"),
        (lambda t: t.all_gather(0, [0], "k", np.ones(1)), TypeError, "non-empty tuple"),
        (lambda t: t.all_gather(0, (0,), 3, np.ones(1)), TypeError, "key must be a str"),
        (lambda t: t.reduce_scatter_sum(0, (0,), "k", []), ValueError, "list of 1 arrays"),
    ],
)
def test_bad_calls_are_refused_by_name(
    transport: TorchDistTransport, call: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        anyio.run(call, transport)


def test_close_wakes_a_waiting_receive_and_refuses_later_calls(
    transport: TorchDistTransport,
) -> None:
    async def main() -> None:
        async def close_soon() -> None:
            await anyio.sleep(0.05)
            transport.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(close_soon)
            with pytest.raises(RuntimeError, match="closed"):
                await transport.recv(0, 0, MessageKey("F", 2, 3))

    anyio.run(main)
    assert transport.closed
    with pytest.raises(RuntimeError, match="TorchDistTransport is closed"):
        anyio.run(transport.send, 0, 0, MessageKey("F", 0, 0), np.ones(1))
    transport.close()  # idempotent


def test_construction_validates_and_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    with pytest.raises(ValueError, match="backend='mpi'; allowed: 'gloo' or 'nccl'"):
        TorchDistTransport(backend="mpi")
    with pytest.raises(ValueError, match="timeout_s=0"):
        TorchDistTransport(timeout_s=0)
    with pytest.raises(ValueError, match="inline_max_bytes=-1 out of range"):
        TorchDistTransport(inline_max_bytes=-1)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        TorchDistTransport()
    assert not dist.is_initialized()


def test_construction_from_the_environment_owns_the_default_group(
    monkeypatch: pytest.MonkeyPatch, unused_tcp_port: int
) -> None:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(unused_tcp_port)}
    for name, value in {**env, "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    with TorchDistTransport(timeout_s=60) as torch_transport:
        assert dist.is_initialized() and torch_transport.world_size == 1
    assert not dist.is_initialized()


# -- the waiting threads, with stand-in works -------------------------------------------------


def test_waiters_complete_and_run_the_continuation() -> None:
    waiters = Waiters()
    first, second = FakeWork(), FakeWork()
    first.finish()

    def then() -> list[tuple[Any, bool]]:
        threading.Timer(0.05, second.finish).start()
        return [(second, True)]  # polled, as an NCCL work

    anyio.run(waiters.complete, [(first, False)], then)
    assert first.waited and second.waited and second.is_completed()
    assert waiters.drain(1.0) == 0


def test_a_failed_work_raises_work_error_with_torchs_message() -> None:
    waiters = Waiters()
    work = FakeWork(error="Connection closed by peer [127.0.0.1]:1234")
    work.finish()
    with pytest.raises(WorkError, match="Connection closed by peer"):
        anyio.run(waiters.complete, [(work, False)])


def test_a_cancelled_wait_returns_at_once_and_its_send_stays_counted() -> None:
    waiters = Waiters()
    work = FakeWork()

    async def main() -> float:
        started = time.monotonic()
        with anyio.move_on_after(0.05):
            await waiters.complete([(work, False)], p2p_send=True)
        return time.monotonic() - started

    assert anyio.run(main) < 1.0
    assert waiters.pending_sends == 1  # gloo still holds the send
    work.finish()
    assert waiters.drain(5.0) == 0


def test_drain_after_close_joins_every_waiting_thread() -> None:
    """Nothing of a closed transport's waiting may run on while Python finalizes: once
    ``drain`` says no job is left, its threads have ended, the idle ones too."""
    before = set(threading.enumerate())
    waiters = Waiters()
    works = [FakeWork() for _ in range(24)]

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for work in works:  # at once: a thread each
                tg.start_soon(waiters.complete, [(work, False)])
            await anyio.sleep(0.05)
            for work in works:
                work.finish()

    anyio.run(main)
    assert waiters.drain(5.0) == 0  # not closed: 24 threads idle, waiting for jobs
    waiters.close()
    assert waiters.drain(5.0) == 0
    started = [t for t in threading.enumerate() if t not in before]
    assert [t for t in started if t.name == "ppswap-torch-dist-wait"] == []


def test_close_fails_a_waiting_call_at_once() -> None:
    waiters = Waiters()
    work = FakeWork()

    async def main() -> None:
        async def close_soon() -> None:
            await anyio.sleep(0.05)
            waiters.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(close_soon)
            with anyio.fail_after(5), pytest.raises(RuntimeError, match="closed while"):
                await waiters.complete([(work, False)])

    anyio.run(main)
    assert waiters.drain(0.05) == 1  # the thread still waits for the work
    work.finish()
    assert waiters.drain(5.0) == 0
    with pytest.raises(RuntimeError, match="TorchDistTransport is closed"):
        anyio.run(waiters.complete, [(FakeWork(), False)])


def test_a_background_wait_reports_its_failure() -> None:
    waiters = Waiters()
    work = FakeWork(error="Connection closed by peer")
    errors: list[BaseException] = []

    async def main() -> None:
        waiters.start([(work, False)], True, errors.append)
        assert waiters.pending_sends == 1
        work.finish()
        with anyio.fail_after(5):
            while not errors:
                await anyio.sleep(0.01)

    anyio.run(main)
    assert isinstance(errors[0], WorkError) and waiters.pending_sends == 0


def test_a_failed_background_send_fails_the_next_call(world_of_one: None) -> None:
    io = MessageIO([], None, 0)
    io._send_failed(WorkError("Connection closed by peer"), ("send", "F1", "to rank", 1))
    assert io.peer_failed
    message = "an earlier send failed: send F1 to rank 1: Connection closed by peer"
    with pytest.raises(RuntimeError, match=message):
        anyio.run(io.recv, 1, 0, (1, 2), ("recv", "B1", "from rank", 1))
