"""Device memory is really released after finish_offload, and everything returns to baseline.

How release is proven: by storage, not by a weakref to the packed object (the pack hook
hands us a *new* Tensor object sharing storage, so its death proves nothing). MindSpore's
CPU allocator hands a freed block out again for the next allocation of the same size; a
block that is still referenced can never be handed out twice. So "a fresh tensor of the
same shape lands at the saved storage's address" proves the storage was freed. Every such
test has a control that keeps one reference alive and must see *no* reuse, which shows
the probe can fail.

Host side: tracemalloc follows numpy's allocations; after the chunk is released, the
graph dropped and the pool cleared, the traced bytes are back to where they started.
"""

from __future__ import annotations

import gc
import tracemalloc

import mindspore as ms
import pytest
from mindspore import Parameter, Tensor, ops
from swap_support import CopyThread, address_reused, release_forward, seeded, settle_allocator

from ppswap.swap import EmulatedDevice, PipelineSwapSession, swap_tensor_wrapper, swap_wrapper

ROWS, COLS = 384, 512  # a 768 KiB activation: large enough to be its own allocator block
SHAPE = (ROWS, COLS)


def _capture(session: PipelineSwapSession, keep: list[Tensor], *, registered: bool):
    settle_allocator(SHAPE)  # so that a freed block of this size is reused (see there)
    w = Parameter(seeded((COLS, COLS), 1, 0.03), name="w")
    x = seeded(SHAPE, 2)

    def block(inp: Tensor) -> Tensor:
        return ops.tanh(ops.matmul(inp, w))

    def remember(t: Tensor) -> bool:
        keep.append(t)  # a reference to the saved tensor: the lingering one of the control
        return True

    if registered:

        def fn(inp: Tensor) -> Tensor:
            y = ops.tanh(ops.matmul(inp, w))  # tanh saves y before it is registered
            swap_tensor_wrapper(y, tag="y")
            return ops.sin(y).sum()

    else:
        wrapped = swap_wrapper(block, policy_fn=remember)

        def fn(inp: Tensor) -> Tensor:
            return wrapped(inp).sum()

    with session.collection_context(0, 0, protected=[x], parameters=[w]):
        _, vjp_fn = ms.vjp(fn, x, weights=[w])
    group = session.manager.get_group(session.group_name(0, 0))
    big = [e for e in group.entries() if e.key.shape == SHAPE and e.key.storage_ptr]
    assert big, "the activation must have been captured"
    return vjp_fn, big[0].key.storage_ptr


@pytest.mark.parametrize("lingering", [False, True])
def test_finish_offload_frees_the_device_storage(make_session, copy_thread, lingering):
    session = make_session()
    keep: list[Tensor] = []
    vjp_fn, ptr = _capture(session, keep, registered=False)
    if not lingering:
        keep.clear()
    copy_thread.run_now(session.prepare_offload(0, 0))
    session.finish_offload(0, 0)
    gc.collect()
    assert address_reused(ptr, SHAPE) is (not lingering)
    release_forward(vjp_fn)


def test_registered_tensor_is_freed_too(make_session, copy_thread):
    """swap_tensor_wrapper's registration must not keep the tensor alive."""
    session = make_session()
    vjp_fn, ptr = _capture(session, [], registered=True)
    copy_thread.run_now(session.prepare_offload(0, 0))
    session.finish_offload(0, 0)
    gc.collect()
    assert address_reused(ptr, SHAPE)
    release_forward(vjp_fn)


def test_host_memory_back_to_baseline_after_round_trip(manager):
    engine = EmulatedDevice()
    copy = CopyThread()
    try:
        gc.collect()
        tracemalloc.start()
        baseline = tracemalloc.get_traced_memory()[0]
        session = PipelineSwapSession(manager, engine, rank=0, generation=1, eligible={(0, 0)})
        vjp_fn, _ = _capture(session, [], registered=False)
        copy.run_now(session.prepare_offload(0, 0))
        session.finish_offload(0, 0)
        held_on_host = tracemalloc.get_traced_memory()[0] - baseline
        assert held_on_host >= ROWS * COLS * 4
        copy.run_now(session.prepare_load(0, 0))
        session.finish_load(0, 0)
        vjp_fn(Tensor(1.0, ms.float32))
        session.release_chunk(0, 0)
        session.close()
        del vjp_fn
        engine.clear_pool()
        gc.collect()
        leftover = tracemalloc.get_traced_memory()[0] - baseline
        assert leftover < 64 * 1024, f"{leftover} bytes of host memory still held"
        stats = session.stats()
        assert stats.resident_saved_bytes == 0 and stats.live_groups == 0
        assert engine.pool_stats().lent == 0 and len(manager) == 0
    finally:
        tracemalloc.stop()
        copy.close()
