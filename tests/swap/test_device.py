"""EmulatedDevice: real copies, the bandwidth floor, the host buffer pool."""

from __future__ import annotations

import threading
import time

import mindspore as ms
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mindspore import ops

from ppswap.backends.host_memory import size_class
from ppswap.swap import CopyEngine, EmulatedDevice


def test_is_a_copy_engine():
    assert isinstance(EmulatedDevice(), CopyEngine)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.bool_, "bfloat16"])
def test_round_trip_copies_exactly(dtype):
    if dtype == "bfloat16":  # the numpy extension dtype MindSpore's asnumpy() returns
        dtype = ops.ones((1,), ms.bfloat16).asnumpy().dtype
    dtype = np.dtype(dtype)
    src = (np.arange(3 * 5 * 7) % 11).astype(dtype).reshape(3, 5, 7)
    engine = EmulatedDevice()
    host = engine.d2h(src)
    assert host.shape == src.shape and host.dtype == src.dtype
    assert not np.shares_memory(host, src)
    back = engine.h2d(host)
    assert not np.shares_memory(back, host)
    assert back.tobytes() == src.tobytes()
    engine.release_host(host)
    counters = engine.counters()
    assert counters.d2h_bytes == counters.h2d_bytes == src.nbytes
    assert counters.d2h_calls == counters.h2d_calls == 1


def test_d2h_into_a_bucket_slice():
    engine = EmulatedDevice()
    raw = engine.acquire_host(256)
    src = np.arange(16, dtype=np.float32)
    engine.d2h_into(src, raw[64:128])
    assert raw[64:128].view(np.float32).tolist() == src.tolist()
    with pytest.raises(ValueError, match="dst has 32 bytes"):
        engine.d2h_into(src, raw[:32])
    engine.release_host(raw)


def _span_bytes(values: list[int]) -> np.ndarray:
    """A storage span's bytes as the swap layer hands them to the engine: 1-D uint8."""
    return np.array(values, dtype=np.int32).view(np.uint8)


def test_d2h_many_copies_each_span_into_a_pooled_buffer_of_its_own():
    engine = EmulatedDevice()
    sources = [_span_bytes(list(range(n))) for n in (3, 1000, 17)]
    hosts = engine.d2h_many(sources)
    for src, host in zip(sources, hosts, strict=True):
        assert host.tobytes() == src.tobytes() and not np.shares_memory(host, src)
    assert engine.pool_stats().lent == 3
    counters = engine.counters()
    assert counters.d2h_calls == 3  # one copy per span
    assert counters.d2h_bytes == sum(src.nbytes for src in sources)
    for host in hosts:
        engine.release_host(host)
    assert engine.pool_stats().lent == 0


def test_d2h_many_gives_its_buffers_back_when_a_copy_fails():
    engine = EmulatedDevice()
    good, bad = _span_bytes([1, 2, 3]), np.arange(3, dtype=np.float32)  # not uint8 bytes
    with pytest.raises(TypeError):
        engine.d2h_many([good, bad])
    assert engine.pool_stats().lent == 0


def test_d2h_many_copies_into_given_slices_and_takes_buffers_only_where_none_is_given():
    engine = EmulatedDevice()
    raw = engine.acquire_host(256)  # a bucket: two spans at 64-byte aligned offsets
    sources = [_span_bytes([1, 2, 3]), _span_bytes([4, 5]), _span_bytes([6])]
    hosts = engine.d2h_many(sources, [raw[0:12], None, raw[64:68]])
    assert [h.tobytes() for h in hosts] == [src.tobytes() for src in sources]
    assert np.shares_memory(hosts[0], raw) and np.shares_memory(hosts[2], raw)
    assert not np.shares_memory(hosts[1], raw)
    assert engine.pool_stats().lent == 2  # the bucket and the one buffer taken here
    with pytest.raises(ValueError, match="a target has 8 bytes, its source 12"):
        engine.d2h_many(sources[:1], [raw[128:136]])
    with pytest.raises(ValueError, match="2 sources but 1 targets"):
        engine.d2h_many(sources[:2], [None])
    with pytest.raises(TypeError):  # the second copy fails: only its own buffer goes back
        engine.d2h_many([sources[0], np.arange(2, dtype=np.float32)], [raw[0:12], None])
    assert engine.pool_stats().lent == 2
    engine.release_host(hosts[1])
    engine.release_host(raw)


def test_h2d_block_loads_every_span_into_one_cached_block():
    engine = EmulatedDevice()
    hosts = [_span_bytes(list(range(n))) for n in (5, 64, 1)]  # 20, 256 and 4 bytes
    offsets = [0, 64, 320]
    loaded = engine.h2d_block(hosts, offsets, 384)
    assert [span.tobytes() for span in loaded] == [host.tobytes() for host in hosts]
    base = loaded[0].ctypes.data
    assert base % 64 == 0
    assert [span.ctypes.data - base for span in loaded] == offsets  # one allocation
    assert engine.block_stats().lent == 1 and engine.counters().h2d_calls == 3
    kept = loaded[1]
    del loaded
    assert engine.block_stats().lent == 1  # a span still in use keeps the whole block
    del kept
    assert engine.block_stats().lent == 0


@pytest.mark.parametrize(
    ("offsets", "nbytes", "message"),
    [
        ([0, 32], 128, "at offset 32 does not fit a 128-byte block at a 64-byte boundary"),
        ([0, 64], 80, "a 20-byte span at offset 64 does not fit a 80-byte block"),
        ([0], 128, "2 hosts but 1 offsets"),
    ],
)
def test_h2d_block_refuses_a_layout_that_does_not_fit(offsets, nbytes, message):
    engine = EmulatedDevice()
    hosts = [_span_bytes([1, 2, 3, 4, 5]), _span_bytes([6, 7, 8, 9, 10])]
    with pytest.raises(ValueError, match=message):
        engine.h2d_block(hosts, offsets, nbytes)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_bandwidth_sets_a_floor_on_copy_time(direction):
    nbytes = 200_000
    engine = EmulatedDevice(**{f"{direction}_gbps": 0.002})  # 2 MB/s -> 100 ms
    src = np.ones(nbytes, dtype=np.uint8)
    started = time.perf_counter()
    out = engine.d2h(src) if direction == "d2h" else engine.h2d(src)
    elapsed = time.perf_counter() - started
    assert elapsed >= nbytes / 2e6 * 0.95
    assert out.tobytes() == src.tobytes()


def test_unthrottled_copy_is_fast():
    engine = EmulatedDevice()
    src = np.ones(1 << 20, dtype=np.uint8)
    started = time.perf_counter()
    engine.release_host(engine.d2h(src))
    assert time.perf_counter() - started < 0.5


def test_pool_reuses_buffers_across_runs():
    engine = EmulatedDevice()
    src = np.ones((256, 64), dtype=np.float32)
    for run in range(3):
        host = engine.d2h(src)
        engine.release_host(host)
        stats = engine.pool_stats()
        assert stats.misses == 1 and stats.hits == run
        assert stats.buffers == 1 and stats.lent == 0
        assert stats.bytes_held == size_class(src.nbytes)
    engine.clear_pool()
    assert engine.pool_stats().buffers == 0 and engine.pool_stats().bytes_held == 0


def test_lent_buffers_are_tracked_and_released_once():
    engine = EmulatedDevice()
    host = engine.d2h(np.zeros(10, np.float32))
    assert engine.pool_stats().lent == 1 and engine.pool_stats().bytes_lent >= 40
    engine.release_host(host[2:5])  # any view of the buffer finds its root
    with pytest.raises(ValueError, match="not a buffer lent by this engine"):
        engine.release_host(host)
    with pytest.raises(ValueError, match="not a buffer lent"):
        engine.release_host(np.zeros(4))


def test_pool_cap_frees_instead_of_keeping():
    engine = EmulatedDevice(max_pool_bytes=4096)
    a, b = engine.acquire_host(100), engine.acquire_host(100)
    engine.release_host(a)
    engine.release_host(b)
    assert engine.pool_stats().buffers == 1


def test_pool_is_thread_safe():
    engine = EmulatedDevice()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for i in range(200):
                buf = engine.d2h(np.full(64 + i % 7, i, dtype=np.int32))
                assert int(buf[0]) == i
                engine.release_host(buf)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == [] and engine.pool_stats().lent == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 34))
def test_size_classes_bound_the_waste(nbytes):
    cls = size_class(nbytes)
    assert cls >= nbytes and cls >= 4096
    assert cls - nbytes <= max(4096, nbytes / 8)  # waste: at most 1/8 or one 4 KiB page
    assert size_class(cls) == cls


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"d2h_gbps": 0}, ValueError, "d2h_gbps"),
        ({"h2d_gbps": -1.0}, ValueError, "h2d_gbps"),
        ({"h2d_gbps": float("nan")}, ValueError, "h2d_gbps"),
        ({"d2h_gbps": "fast"}, TypeError, "d2h_gbps"),
        ({"d2h_gbps": True}, TypeError, "d2h_gbps"),
        ({"max_pool_bytes": -1}, ValueError, "max_pool_bytes"),
    ],
)
def test_bad_engine_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        EmulatedDevice(**kwargs)


# -- the cached device blocks loads land in -----------------------------------------------


def test_a_load_reuses_a_cached_block_once_nothing_uses_it():
    engine = EmulatedDevice()
    host = engine.d2h(np.arange(1000, dtype=np.float32))
    first = engine.h2d(host)
    assert first.ctypes.data % 64 == 0 and first.flags.c_contiguous
    address = first.ctypes.data
    assert engine.block_stats().lent == 1
    del first
    stats = engine.block_stats()
    assert stats.lent == 0 and stats.buffers == 1 and stats.misses == 1
    again = engine.h2d(host)
    assert again.ctypes.data == address  # the same memory, no new allocation
    assert engine.block_stats().hits == 1
    assert again.tolist() == list(range(1000))
    engine.release_host(host)


def test_a_block_in_use_is_never_handed_out_again():
    engine = EmulatedDevice()
    ones, twos = np.ones(4096, np.float32), np.full(4096, 2, np.float32)
    held = engine.h2d(ones)[100:200]  # only a view of the loaded array is kept
    other = engine.h2d(twos)
    assert not np.shares_memory(held, other)
    assert engine.block_stats().lent == 2
    assert held.tolist() == [1.0] * 100 and other.tolist() == [2.0] * 4096


def test_a_framework_tensor_keeps_its_block_until_it_is_freed():
    engine = EmulatedDevice()
    loaded = engine.h2d(np.arange(64, dtype=np.float32))
    tensor = ms.Tensor.from_numpy(loaded[16:])  # shares the block's memory
    del loaded
    assert engine.block_stats().lent == 1
    assert float(tensor.sum().asnumpy()) == float(sum(range(16, 64)))
    del tensor
    assert engine.block_stats().lent == 0 and engine.block_stats().buffers == 1


def test_a_block_freed_on_another_thread_comes_back():
    engine = EmulatedDevice()
    box = [engine.h2d(np.zeros(5000, np.uint8))]
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join(10)
    assert engine.block_stats().lent == 0
    engine.clear_pool()
    assert engine.block_stats().buffers == 0


def test_a_strided_load_is_not_a_cached_block():
    engine = EmulatedDevice()
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    back = engine.h2d(host, (1, 3))  # column-major
    assert back.strides == (4, 12) and back.tolist() == host.tolist()
    assert engine.block_stats().misses == 0
