"""One regression test per failure mode seen in other activation-offload systems.

(Megatron-LM, TransformerEngine, torchtune, TRL and HyperParallel have shipped each of
these as wrong gradients, NaNs, leaks or freed aliases.) Every test uses real MindSpore
modules and a real copy thread; slow copies come from a low-bandwidth EmulatedDevice.
"""

from __future__ import annotations

import gc

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops
from swap_support import (
    MLP,
    CopyThread,
    GatedDevice,
    assert_bit_identical,
    backward,
    forward,
    full_round_trip,
    loss_of,
    open_later,
    reference_grads,
    release_forward,
    seeded,
    wait_until,
)

from ppswap.backends.mindspore import BACKEND as MINDSPORE
from ppswap.swap import (
    EmulatedDevice,
    PipelineSwapSession,
    SwapError,
    SwapManager,
    SwapState,
    SwapStateError,
    module_state_tensors,
    swap_wrapper,
)

SLOW_GBPS = 0.003  # 3 MB/s: a few hundred KiB take ~100 ms


def _big_mlp(group_swap: bool = False) -> tuple[MLP, Tensor]:
    model = MLP(dim=64, hidden=256, blocks=2)
    for i in range(len(model.layers)):
        model.layers[i] = swap_wrapper(model.layers[i], group_swap=group_swap)
    return model, seeded((64, 64), 3)


def _collect(session, model, x, micro=0):
    params = model.trainable_params()
    with session.collection_context(0, micro, protected=[x], parameters=params):
        _, vjp_fn = forward(loss_of(model), x, params)
    return vjp_fn


def _moving(session, micro=0):
    group = session.manager.get_group(session.group_name(0, micro))
    return [e for e in group.entries() if not e.pinned]


@pytest.mark.parametrize("group_swap", [False, True])
def test_backward_waits_for_a_load_still_running(manager, copy_thread, group_swap):
    model, x = _big_mlp(group_swap)
    expected = reference_grads(loss_of(model), x, model.trainable_params())
    engine = GatedDevice()
    session = PipelineSwapSession(manager, engine, rank=0, generation=1, eligible={(0, 0)})
    vjp_fn = _collect(session, model, x)
    copy_thread.run_now(session.prepare_offload(0, 0))
    session.finish_offload(0, 0)
    engine.h2d_gate.clear()  # the load starts and then stays in flight
    job = copy_thread.submit(session.prepare_load(0, 0))
    wait_until(lambda: job.started)
    assert not job.done.is_set(), "the load must still be running"
    open_later(engine.h2d_gate)
    got = backward(vjp_fn)  # unpack must wait, never read half-written data
    assert job.done.is_set()
    assert_bit_identical(expected, got)
    assert session.stats().unpack_waited_loads >= 1
    assert session.finish_load(0, 0) == 0  # the safety net already completed every entry
    session.release_chunk(0, 0)
    session.close()
    assert engine.pool_stats().lent == 0


def test_storage_stays_alive_while_its_offload_is_in_flight(manager, copy_thread):
    model, x = _big_mlp()
    expected = reference_grads(loss_of(model), x, model.trainable_params())
    engine = GatedDevice()
    session = PipelineSwapSession(manager, engine, rank=0, generation=1, eligible={(0, 0)})
    vjp_fn = _collect(session, model, x)
    engine.d2h_gate.clear()
    job = copy_thread.submit(session.prepare_offload(0, 0))
    wait_until(lambda: job.started)
    assert not job.done.is_set()
    # Releasing the device memory now would let the copy read freed memory: refused.
    with pytest.raises(SwapStateError, match=r"D2H -> HOST"):
        session.finish_offload(0, 0)
    moving = _moving(session)
    assert all(e.state is SwapState.D2H and e.device is not None for e in moving)
    # Churn the allocator while the copy runs: nothing the copy reads may be reused.
    churn = [ops.ones((64, 256), ms.float32) * 7.0 for _ in range(32)]
    for t in churn:
        t.asnumpy()
    engine.d2h_gate.set()
    assert job.done.wait(10)
    assert session.finish_offload(0, 0) > 0
    copy_thread.run_now(session.prepare_load(0, 0))
    session.finish_load(0, 0)
    assert_bit_identical(expected, backward(vjp_fn))
    session.release_chunk(0, 0)
    session.close()


def test_backward_during_offload_uses_the_live_device_tensor(manager, copy_thread):
    model, x = _big_mlp()
    expected = reference_grads(loss_of(model), x, model.trainable_params())
    engine = EmulatedDevice(d2h_gbps=SLOW_GBPS)
    session = PipelineSwapSession(manager, engine, rank=0, generation=1, eligible={(0, 0)})
    vjp_fn = _collect(session, model, x)
    job = copy_thread.submit(session.prepare_offload(0, 0))
    assert_bit_identical(expected, backward(vjp_fn))
    assert session.stats().unpack_device_fallbacks >= 1
    assert job.done.wait(10)
    session.finish_offload(0, 0)
    session.release_chunk(0, 0)
    session.close()
    assert engine.pool_stats().lent == 0


def test_no_reference_lingers_after_finish_offload(make_session, copy_thread):
    """Every path that could keep the device memory alive is cleared (see test_memory)."""
    model, x = _big_mlp(group_swap=True)
    session = make_session()
    vjp_fn = _collect(session, model, x)
    job = copy_thread.run_now(session.prepare_offload(0, 0))
    session.finish_offload(0, 0)
    for entry in _moving(session):
        assert entry.device is None and entry.device_block is None
        assert entry.job is None
    group = session.manager.get_group(session.group_name(0, 0))
    assert group._offload is None  # the staging numpy views (they pin device memory)
    assert job._work is None  # the finished job dropped its closure (and the views in it)
    release_forward(vjp_fn)


class _SharedTableLayer(nn.Cell):
    """Uses a table shared by every layer (a rotary-style attribute, not a Parameter)."""

    def __init__(self, table: Tensor, dim: int, seed: int) -> None:
        super().__init__()
        self.table = table
        self.dense = nn.Dense(dim, dim)
        self.dense.weight.set_data(seeded((dim, dim), seed, 0.3))

    def construct(self, x: Tensor) -> Tensor:
        return ops.tanh(self.dense(x) * self.table)


class _TableArgLayer(nn.Cell):
    """Gets the shared table as an argument from its parent."""

    def __init__(self, dim: int, seed: int) -> None:
        super().__init__()
        self.dense = nn.Dense(dim, dim)
        self.dense.weight.set_data(seeded((dim, dim), seed, 0.3))

    def construct(self, x: Tensor, table: Tensor) -> Tensor:
        return ops.tanh(self.dense(x) * table)


class _TableModel(nn.Cell):
    def __init__(self, as_argument: bool, dim: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.table = seeded((dim,), 99)
        self.as_argument = as_argument
        if as_argument:
            layers = [_TableArgLayer(dim, i) for i in range(blocks)]
        else:
            layers = [_SharedTableLayer(self.table, dim, i) for i in range(blocks)]
        self.layers = nn.CellList([swap_wrapper(layer) for layer in layers])

    def construct(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, self.table) if self.as_argument else layer(x)
        return x


@pytest.mark.parametrize(
    ("as_argument", "pass_module_state", "offload_first"),
    [
        (False, False, False),  # attribute of every wrapped layer: module state
        (True, True, False),  # argument; the stage passes module_state_tensors(model)
        (True, False, False),  # argument, unknown to everyone: cross-chunk detection
        (True, False, True),  # same, and micro 0 is already offloading during FWD 1
    ],
)
def test_table_shared_by_every_layer_is_never_freed_or_corrupted(
    make_session, copy_thread, as_argument, pass_module_state, offload_first
):
    model = _TableModel(as_argument)
    params = model.trainable_params()
    fn = loss_of(model)
    xs = [seeded((8, 32), 10 + m) for m in range(2)]
    expected = [reference_grads(fn, x, params) for x in xs]
    table_bytes = model.table.asnumpy().tobytes()
    table_ptr = model.table.untyped_storage().data_ptr()
    state = module_state_tensors(model) if pass_module_state else params
    session = make_session(eligible={(0, 0), (0, 1)})
    vjps = []
    jobs = {}
    for m, x in enumerate(xs):
        with session.collection_context(0, m, protected=[x], parameters=state):
            vjps.append(forward(fn, x, params)[1])
        if offload_first and m == 0:
            jobs[0] = copy_thread.run_now(session.prepare_offload(0, 0))
    for m in range(2):
        if m not in jobs:
            copy_thread.run_now(session.prepare_offload(0, m))
        session.finish_offload(0, m)
    holders = {
        m: [
            e
            for e in session.manager.get_group(session.group_name(0, m)).entries()
            if e.key.storage_ptr == table_ptr
        ]
        for m in range(2)
    }
    assert holders[1] == []  # micro 1 saw the table held by micro 0: never captured
    if pass_module_state or not as_argument:
        assert holders[0] == []  # known module state: never captured at all
    elif offload_first:
        # Micro 0 copied it before the sharing was visible: harmless (handles never
        # free memory themselves), and the table stays counted through micro 1's ledger.
        assert [e.state for e in holders[0]] == [SwapState.HOST]
    else:
        assert holders[0] and all(e.pinned for e in holders[0])  # pinned by micro 1
        assert all(e.state is SwapState.DEVICE for e in holders[0])
    # Honest accounting: wherever the table was saved, it is counted as resident.
    counted = session.accounting.chunks_holding(("storage", table_ptr))
    assert bool(counted) is not (pass_module_state or not as_argument)
    gc.collect()
    for m in (1, 0):
        full_load = session.prepare_load(0, m)
        copy_thread.run_now(full_load)
        session.finish_load(0, m)
        assert_bit_identical(expected[m], backward(vjps[m]))
        session.release_chunk(0, m)
    assert model.table.untyped_storage().nbytes() == len(table_bytes)
    assert model.table.asnumpy().tobytes() == table_bytes
    session.close()


@pytest.mark.parametrize("group_swap", [False, True])
def test_views_sharing_a_storage_are_separate_entries_restored_right(
    manager, engine, copy_thread, group_swap
):
    base = ops.tanh(seeded((6, 12), 4))
    views = {
        "base": base,
        "T": base.transpose(1, 0),
        "left": base[:, :4],
        "right": base[:, 4:8],
        "row": base[2],
        "T again": base.transpose(1, 0),
    }
    expected = {name: view.asnumpy().copy() for name, view in views.items()}
    group = manager.create_group("views", 0, 0, engine=EmulatedDevice(), group_swap=group_swap)
    handles = {name: group.register(view, tag=name) for name, view in views.items()}
    assert handles["T again"] is handles["T"]  # the exact same view: one entry
    assert len(group) == 5  # the base and every other view: separate entries
    assert len({e.key.storage_ptr for e in group.entries()}) == 1
    group.seal()
    copy_thread.run_now(group.prepare_offload())
    group.finish_offload()
    assert {e.state for e in group.entries()} == {SwapState.HOST}
    copy_thread.run_now(group.prepare_load())
    group.finish_load()
    for name, handle in handles.items():
        restored = handle.materialize().asnumpy()
        assert restored.shape == expected[name].shape
        assert restored.tobytes() == np.ascontiguousarray(expected[name]).tobytes(), name
    group.release()
    assert engine.pool_stats().lent == 0


@pytest.mark.parametrize("group_swap", [False, True])
def test_saved_views_under_autograd_restore_right(make_session, copy_thread, group_swap):
    """Whatever views MindSpore saves (it makes most of them contiguous first)."""
    w = Parameter(seeded((12, 12), 5, 0.3), name="w")
    x = seeded((6, 12), 6)
    seen: dict[tuple, np.ndarray] = {}

    def record(t: Tensor) -> bool:
        seen.setdefault(
            (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride())),
            t.asnumpy().copy(),
        )
        return True

    def block(inp: Tensor) -> Tensor:
        y = ops.tanh(ops.matmul(inp, w))
        yt = y.transpose(1, 0)  # a strided view of y's storage
        left, right = y[:, :4], y[:, 4:8]  # two slices: offsets into the same storage
        return ops.matmul(yt, y).sum() + (left * right).sum() + ops.matmul(yt, y).mean()

    wrapped = swap_wrapper(block, policy_fn=record, group_swap=group_swap)
    expected = reference_grads(block, x, [w])
    session = make_session()
    with session.collection_context(0, 0, protected=[x], parameters=[w]):
        _, vjp_fn = forward(wrapped, x, [w])
    entries = _moving(session)
    keys = {(e.key.storage_ptr, e.key.offset, e.key.shape, e.key.strides) for e in entries}
    assert len(keys) == len(entries) == len(seen)  # one entry per distinct view, no more
    full_round_trip(session, 0, 0, copy_thread)
    for entry in entries:
        key = (entry.key.storage_ptr, entry.key.offset, entry.key.shape, entry.key.strides)
        restored = entry.device.asnumpy()
        assert restored.shape == entry.key.shape
        assert restored.tobytes() == np.ascontiguousarray(seen[key]).tobytes()
    assert_bit_identical(expected, backward(vjp_fn))
    session.release_chunk(0, 0)


def test_stale_storage_keys_across_generations(manager, engine, copy_thread):
    model, _ = _big_mlp()
    params = model.trainable_params()
    xs = {1: seeded((64, 64), 21), 2: seeded((64, 64), 22)}
    expected = {g: reference_grads(loss_of(model), xs[g], params) for g in xs}
    assert expected[1][0].tobytes() != expected[2][0].tobytes()
    first = PipelineSwapSession(manager, engine, rank=0, generation=1, eligible={(0, 0)})
    vjp_fn = _collect(first, model, xs[1])
    old_entries = _moving(first)
    old_ptrs = {e.key.storage_ptr for e in old_entries}
    full_round_trip(first, 0, 0, copy_thread)
    assert_bit_identical(expected[1], backward(vjp_fn))
    first.release_chunk(0, 0)
    first.close()
    del vjp_fn
    gc.collect()

    second = PipelineSwapSession(manager, engine, rank=0, generation=2, eligible={(0, 0)})
    vjp_fn = _collect(second, model, xs[2])
    assert second.group_name(0, 0) == "pp_swap_run2_s0_m0" != first.group_name(0, 0)
    new_entries = _moving(second)
    # The sharp case is the allocator handing the old addresses out again (it does in a
    # fresh process: ``old_ptrs`` meets the new ones); after many other tests its free
    # lists may differ, and the generations must stay apart all the same.
    assert old_ptrs
    assert not {id(e) for e in new_entries} & {id(e) for e in old_entries}
    assert all(e.state is SwapState.DEVICE for e in new_entries)
    full_round_trip(second, 0, 0, copy_thread)
    assert_bit_identical(expected[2], backward(vjp_fn))
    second.release_chunk(0, 0)
    second.close()
    # A group left over under a name (an aborted run that did not clean up) is refused,
    # never silently reused.
    manager.create_group("pp_swap_run3_s0_m0", 0, 0, engine=EmulatedDevice())
    third = PipelineSwapSession(manager, engine, rank=0, generation=3, eligible={(0, 0)})
    with (
        pytest.raises(SwapError, match="already exists"),
        third.collection_context(0, 0),
    ):
        pass


def test_unpacking_a_released_chunk_raises(make_session, copy_thread):
    model, x = _big_mlp()
    session = make_session()
    vjp_fn = _collect(session, model, x)
    copy_thread.run_now(session.prepare_offload(0, 0))
    session.finish_offload(0, 0)
    session.release_chunk(0, 0)  # a bug: released before its backward
    with pytest.raises(SwapStateError, match="released"):
        backward(vjp_fn)


def test_group_packing_keeps_aliases_intact(manager, copy_thread):
    """Bucketing must never move or rewrite a pinned alias, nor mix up members."""
    w = Parameter(seeded((16, 16), 8, 0.3), name="w")
    x = seeded((8, 16), 9)

    def block(inp: Tensor) -> Tensor:
        y = ops.tanh(ops.matmul(inp, w))  # tanh saves its output y, which is also returned
        return y * ops.sigmoid(y.transpose(1, 0)).sum()

    wrapped = swap_wrapper(block, group_swap=True)
    ref_out, ref_vjp = ms.vjp(block, x, weights=[w])
    expected = [g.asnumpy().copy() for grads in ref_vjp(ops.ones_like(ref_out)) for g in grads]
    session = PipelineSwapSession(
        manager, EmulatedDevice(), rank=0, generation=1, eligible={(0, 0)}, bucket_bytes=256
    )
    with session.collection_context(0, 0, protected=[x], parameters=[w]):
        out, vjp_fn = ms.vjp(wrapped, x, weights=[w])
    out_bytes = out.asnumpy().tobytes()
    session.protect_aliases(0, 0, [out])
    group = manager.get_group(session.group_name(0, 0))
    out_ptr = out.untyped_storage().data_ptr()
    aliased = [e for e in group.entries() if e.key.storage_ptr == out_ptr]
    assert all(e.pinned for e in aliased)
    full_round_trip(session, 0, 0, copy_thread)
    moved = [e for e in group.entries() if not e.pinned]
    assert moved and len({id(e.host_bucket) for e in moved}) >= 1
    assert session.stats().offloaded_bytes == sum(e.nbytes for e in moved)
    for entry in aliased:
        assert entry.device.untyped_storage().data_ptr() == out_ptr
    assert out.asnumpy().tobytes() == out_bytes
    assert out.untyped_storage().data_ptr() == out_ptr
    dx, dw = vjp_fn(ops.ones_like(out))
    assert_bit_identical(expected, [g.asnumpy().copy() for g in (*dx, *dw)])
    session.release_chunk(0, 0)
    session.close()


def test_backward_in_an_unexpected_order(manager, copy_thread):
    """Backward consumes chunks in another order than the loads ran, each in another state.

    (MindSpore 2.10 PyNative only runs outstanding vjp graphs last-in first-out, so the
    backward order is 2, 1, 0; the loads were issued 0 first and 2 never.)
    """
    model, _ = _big_mlp(group_swap=True)
    params = model.trainable_params()
    xs = [seeded((64, 64), 30 + m) for m in range(3)]
    expected = [reference_grads(loss_of(model), x, params) for x in xs]
    engine = GatedDevice()
    session = PipelineSwapSession(
        manager, engine, rank=0, generation=1, eligible={(0, 0), (0, 1), (0, 2)}
    )
    vjps = [_collect(session, model, x, micro=m) for m, x in enumerate(xs)]
    for m in range(3):
        copy_thread.run_now(session.prepare_offload(0, m))
        session.finish_offload(0, m)
    copy_thread.run_now(session.prepare_load(0, 0))
    session.finish_load(0, 0)  # chunk 0: loaded first although consumed last
    engine.h2d_gate.clear()
    slow = copy_thread.submit(session.prepare_load(0, 1))  # chunk 1: load in flight
    wait_until(lambda: slow.started)
    # chunk 2: still HOST (its load never launched), consumed first
    assert_bit_identical(expected[2], backward(vjps[2]))
    assert not slow.done.is_set()
    open_later(engine.h2d_gate)
    for m in (1, 0):
        assert_bit_identical(expected[m], backward(vjps[m]))
    assert slow.done.is_set()
    stats = session.stats()
    assert stats.unpack_sync_loads > 0 and stats.unpack_waited_loads > 0
    session.finish_load(0, 1)
    for m in (1, 2, 0):
        session.release_chunk(0, m)
    session.close()
    assert engine.pool_stats().lent == 0


def test_copy_thread_is_not_the_compute_thread():
    thread = CopyThread()
    try:
        engine = EmulatedDevice()
        manager = SwapManager(MINDSPORE)
        session = PipelineSwapSession(manager, engine, rank=0, generation=1, eligible={(0, 0)})
        model, x = _big_mlp()
        vjp_fn = _collect(session, model, x)
        full_round_trip(session, 0, 0, thread)
        backward(vjp_fn)
        session.release_chunk(0, 0)
        session.close()
        assert thread.errors == [] and len(thread.ran) == 2
    finally:
        thread.close()
