"""Gradients with swap are bit-identical to gradients without, for every path.

Models: a residual MLP and a small attention stack (layernorm, matmul, transpose,
softmax), each block wrapped with swap_wrapper. Paths: a normal round trip through a real
copy thread (DEVICE -> D2H -> HOST -> H2D -> DEVICE), with group_swap on and off, with
small buckets (several per group), and the safety nets (load never launched, load still
running, offload still running).
"""

from __future__ import annotations

import threading

import pytest
from swap_support import (
    MLP,
    AttentionStack,
    assert_bit_identical,
    backward,
    forward,
    loss_of,
    reference_grads,
    release_forward,
    seeded,
)

from ppswap.swap import EmulatedDevice, PipelineSwapSession, SwapError, SwapState, swap_wrapper

MODELS = {
    "mlp": (lambda: MLP(dim=16, hidden=32, blocks=3), (8, 16)),
    "attention": (lambda: AttentionStack(dim=16, blocks=2), (2, 6, 16)),
}


def _wrapped(name: str, group_swap: bool):
    build, shape = MODELS[name]
    model = build()
    for i in range(len(model.layers)):
        model.layers[i] = swap_wrapper(model.layers[i], group_swap=group_swap)
    return model, seeded(shape, 7)


@pytest.mark.parametrize("group_swap", [False, True])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_round_trip_gradients_bit_identical(make_session, copy_thread, name, group_swap):
    model, x = _wrapped(name, group_swap)
    params = model.trainable_params()
    fn = loss_of(model)
    expected = reference_grads(fn, x, params)
    session = make_session()
    with session.collection_context(0, 0, protected=[x], parameters=params):
        loss, vjp_fn = forward(fn, x, params)
    session.protect_aliases(0, 0, [loss])
    group = session.manager.get_group(session.group_name(0, 0))
    moving = [e for e in group.entries() if not e.pinned]
    staying = [e for e in group.entries() if e.pinned]
    assert moving, "swap_wrapper must have selected the blocks' saved tensors"

    copy_thread.run_now(session.prepare_offload(0, 0))
    assert {e.state for e in moving} == {SwapState.D2H}
    released = session.finish_offload(0, 0)
    assert released > 0
    assert {e.state for e in moving} == {SwapState.HOST}
    assert all(e.device is None for e in moving)
    assert {e.state for e in staying} <= {SwapState.DEVICE}

    copy_thread.run_now(session.prepare_load(0, 0))
    assert {e.state for e in moving} == {SwapState.H2D}
    restored = session.finish_load(0, 0)
    assert restored == sum(e.nbytes for e in moving)
    assert {e.state for e in group.entries()} == {SwapState.DEVICE}

    assert_bit_identical(expected, backward(vjp_fn))
    stats = session.stats()
    assert stats.unpack_sync_loads == stats.unpack_waited_loads == 0
    assert stats.offloaded_bytes == stats.loaded_bytes == restored

    session.release_chunk(0, 0)
    session.close()
    after = session.stats()
    assert after.resident_saved_bytes == 0
    assert after.live_groups == after.live_chunks == 0
    assert len(session.manager) == session.baseline_groups
    assert session.engine.pool_stats().lent == 0


def _collected(manager, name: str, group_swap: bool, *, bucket_bytes: int):
    """Chunk (0, 0) of model ``name`` collected by a session of its own engine with
    ``bucket_bytes``: the session, the engine, the reference gradients, the vjp."""
    model, x = _wrapped(name, group_swap)
    params = model.trainable_params()
    fn = loss_of(model)
    expected = reference_grads(fn, x, params)
    engine = EmulatedDevice()
    session = PipelineSwapSession(
        manager, engine, rank=0, generation=3, eligible={(0, 0)}, bucket_bytes=bucket_bytes
    )
    with session.collection_context(0, 0, protected=[x], parameters=params):
        _, vjp_fn = forward(fn, x, params)
    return session, engine, expected, vjp_fn


@pytest.mark.parametrize("name", sorted(MODELS))
def test_small_buckets_split_a_group_and_restore_exactly(manager, copy_thread, name):
    session, engine, expected, vjp_fn = _collected(manager, name, True, bucket_bytes=1024)
    job = session.prepare_offload(0, 0)
    group = manager.get_group(session.group_name(0, 0))
    copy_thread.run_now(job)
    session.finish_offload(0, 0)
    moving = [e for e in group.entries() if not e.pinned]
    buckets = {id(e.host_bucket) for e in moving}
    assert len(buckets) > 1, "bucket_bytes=1024 must split the group"
    for entry in moving:
        bucket = entry.host_bucket
        assert bucket.nbytes <= 1024 or len(bucket.members) == 1
    copy_thread.run_now(session.prepare_load(0, 0))
    session.finish_load(0, 0)
    assert_bit_identical(expected, backward(vjp_fn))
    session.release_chunk(0, 0)
    session.close()
    assert engine.pool_stats().lent == 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_load_places_its_spans_in_blocks_of_at_most_bucket_bytes(manager, copy_thread, name):
    """Spans with host buffers of their own (no group_swap) land in one device allocation
    per load, split at ``bucket_bytes`` as buckets are; the blocks go with the chunk."""
    session, engine, expected, vjp_fn = _collected(manager, name, False, bucket_bytes=2048)
    group = manager.get_group(session.group_name(0, 0))
    copy_thread.run_now(session.prepare_offload(0, 0))
    session.finish_offload(0, 0)
    spans = group.spans()
    assert engine.pool_stats().lent == len(spans)  # a host buffer per span
    sizes = [span.nbytes for span in spans]
    expected_blocks, used = 0, None
    for size in sizes:  # the buckets' placement rule: in order, aligned, <= 2048
        if used is not None and -(-used // 64) * 64 + size <= 2048:
            used = -(-used // 64) * 64 + size
        else:
            expected_blocks, used = expected_blocks + 1, size
    assert 1 < expected_blocks < len(spans), sizes
    copy_thread.run_now(session.prepare_load(0, 0))
    session.finish_load(0, 0)
    assert engine.block_stats().lent == expected_blocks
    assert_bit_identical(expected, backward(vjp_fn))
    session.release_chunk(0, 0)
    session.close()
    del vjp_fn
    assert engine.pool_stats().lent == 0 and engine.block_stats().lent == 0


@pytest.mark.parametrize("group_swap", [False, True])
def test_an_offload_refused_by_its_check_leaves_no_host_buffer_lent(
    make_session, copy_thread, group_swap
):
    """The offload's one engine call copies every span before the checks run: a span
    modified in place between the launch and the copy fails the job at its check, and
    every buffer taken (the spans after it included) goes back when the chunk does."""
    model, x = _wrapped("mlp", group_swap)
    params = model.trainable_params()
    session = make_session()
    with session.collection_context(0, 0, protected=[x], parameters=params):
        _, vjp_fn = forward(loss_of(model), x, params)
    group = session.manager.get_group(session.group_name(0, 0))
    spans = group.spans()
    assert len(spans) > 2
    job = session.prepare_offload(0, 0)
    spans[0].entries[0].device.asnumpy()[:] += 1.0  # on CPU a view: in place
    copy_thread.run_now(job)
    assert isinstance(job.error, SwapError) and "modified in place" in str(job.error)
    assert session.engine.pool_stats().lent > 0
    with pytest.raises(SwapError, match="modified in place after capture"):
        session.finish_offload(0, 0)
    release_forward(vjp_fn)
    session.abort()
    assert session.engine.pool_stats().lent == 0


@pytest.mark.parametrize("group_swap", [False, True])
def test_backward_without_load_loads_synchronously(make_session, copy_thread, group_swap):
    model, x = _wrapped("attention", group_swap)
    params = model.trainable_params()
    fn = loss_of(model)
    expected = reference_grads(fn, x, params)
    session = make_session()
    with session.collection_context(0, 0, protected=[x], parameters=params):
        _, vjp_fn = forward(fn, x, params)
    copy_thread.run_now(session.prepare_offload(0, 0))
    session.finish_offload(0, 0)
    group = session.manager.get_group(session.group_name(0, 0))
    assert_bit_identical(expected, backward(vjp_fn))  # no prepare_load at all
    assert session.stats().unpack_sync_loads == sum(1 for e in group.entries() if not e.pinned)
    assert {e.state for e in group.entries()} == {SwapState.DEVICE}
    # The planned load that comes late finds nothing left to move.
    late = session.prepare_load(0, 0)
    assert late.nbytes == 0
    copy_thread.run_now(late)
    assert session.finish_load(0, 0) == 0
    session.release_chunk(0, 0)
    session.close()
    assert session.engine.pool_stats().lent == 0


def test_round_trips_on_the_compute_thread_only(make_session, copy_thread):
    """The copy jobs run on the copy thread; MindSpore is only called on this thread."""
    model, x = _wrapped("mlp", True)
    params = model.trainable_params()
    session = make_session()
    with session.collection_context(0, 0, protected=[x], parameters=params):
        _, vjp_fn = forward(loss_of(model), x, params)
    job = copy_thread.run_now(session.prepare_offload(0, 0))
    assert job in copy_thread.ran and copy_thread.ident != threading.get_ident()
    session.finish_offload(0, 0)
    copy_thread.run_now(session.prepare_load(0, 0))
    session.finish_load(0, 0)
    backward(vjp_fn)
    session.release_chunk(0, 0)
    assert copy_thread.errors == []
