"""PipelineSwapSession: eligibility, ledger, stats, integrity checks, close and abort."""

from __future__ import annotations

import threading

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, ops
from swap_support import (
    MLP,
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
    SwapTimeoutError,
    swap_wrapper,
)
from ppswap.swap.tensor import DIGEST_SAMPLES, content_digest


def _model(group_swap: bool = False) -> MLP:
    model = MLP(dim=32, hidden=64, blocks=2)
    for i in range(2):
        model.layers[i] = swap_wrapper(model.layers[i], group_swap=group_swap)
    return model


def _collect(session, model, x, micro=0, stage=0):
    params = model.trainable_params()
    with session.collection_context(stage, micro, protected=[x], parameters=params):
        out, vjp_fn = forward(loss_of(model), x, params)
    session.protect_aliases(stage, micro, [out])
    return vjp_fn


# -- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"manager": object()}, TypeError, "manager must be a SwapManager"),
        ({"engine": object()}, TypeError, "engine must implement CopyEngine"),
        ({"rank": -1}, ValueError, "rank"),
        ({"rank": True}, TypeError, "rank"),
        ({"generation": "1"}, TypeError, "generation"),
        ({"eligible": [(0,)]}, TypeError, "eligible items"),
        ({"eligible": "00"}, TypeError, "eligible must be a collection"),
        ({"eligible": [(0, -2)]}, ValueError, "eligible micro"),
        ({"wait_timeout_s": 0}, ValueError, "wait_timeout_s"),
        ({"wait_timeout_s": float("inf")}, ValueError, "wait_timeout_s"),
        ({"wait_timeout_s": None}, TypeError, "wait_timeout_s"),
    ],
)
def test_bad_session_arguments(kwargs, error, match):
    options = {
        "manager": SwapManager(MINDSPORE),
        "engine": EmulatedDevice(),
        "rank": 0,
        "generation": 0,
        "eligible": [(0, 0)],
    }
    options.update(kwargs)
    manager, engine = options.pop("manager"), options.pop("engine")
    with pytest.raises(error, match=match):
        PipelineSwapSession(manager, engine, **options)


def test_group_names_carry_generation_stage_and_micro(make_session):
    session = make_session(eligible={(3, 5)}, generation=7)
    assert session.group_name(3, 5) == "pp_swap_run7_s3_m5"
    assert session.is_eligible(3, 5) and not session.is_eligible(5, 3)


# -- eligibility and the ledger ----------------------------------------------------------------


def test_unselected_chunk_has_no_group_and_copies_nothing(make_session, engine):
    session = make_session(eligible=())
    model = _model()
    x = seeded((16, 32), 1)
    expected = reference_grads(loss_of(model), x, model.trainable_params())
    vjp_fn = _collect(session, model, x)
    assert len(session.manager) == 0
    stats = session.stats()
    assert stats.live_groups == 0 and stats.live_chunks == 1
    assert stats.resident_saved_bytes > 0 and stats.peak_saved_bytes == stats.resident_saved_bytes
    with pytest.raises(SwapError, match="not eligible"):
        session.prepare_offload(0, 0)
    assert_bit_identical(expected, backward(vjp_fn))
    session.release_chunk(0, 0)
    assert session.stats().resident_saved_bytes == 0
    assert engine.counters().d2h_calls == engine.counters().h2d_calls == 0
    session.close()


def test_ledger_counts_each_storage_once_and_skips_parameters(make_session):
    w = Parameter(seeded((64, 64), 1), name="w")
    x = seeded((32, 64), 2)

    def fn(t: Tensor) -> Tensor:
        y = ops.matmul(t, w)  # saves t (protected input) and w (parameter)
        return (ops.sin(y) * ops.cos(y)).sum()  # saves y twice, sin(y) and cos(y)

    session = make_session(eligible=())
    with session.collection_context(0, 0, protected=[x], parameters=[w]):
        _, vjp_fn = ms.vjp(fn, x, weights=[w])
    row = 32 * 64 * 4
    # x, y, sin(y), cos(y) (and maybe a cos/sin intermediate), never w, never y twice
    assert 4 * row <= session.stats().resident_saved_bytes < 4 * row + 64 * 64 * 4
    release_forward(vjp_fn)
    session.release_chunk(0, 0)


def test_protected_inputs_are_counted_but_never_moved(make_session, copy_thread):
    session = make_session()
    model = _model()
    x = seeded((16, 32), 1)
    vjp_fn = _collect(session, model, x)
    group = session.manager.get_group(session.group_name(0, 0))
    x_ptr = x.untyped_storage().data_ptr()
    assert all(e.key.storage_ptr != x_ptr for e in group.entries())
    assert session.accounting.chunks_holding(("storage", x_ptr)) == {(0, 0)}
    full_round_trip(session, 0, 0, copy_thread)
    assert session.accounting.chunks_holding(("storage", x_ptr)) == {(0, 0)}
    backward(vjp_fn)
    session.release_chunk(0, 0)


def test_resident_and_peak_follow_the_moves(make_session, copy_thread):
    session = make_session(eligible={(0, 0), (0, 1)})
    model = _model(group_swap=True)
    xs = [seeded((16, 32), m) for m in range(2)]
    vjps = [_collect(session, model, x, micro=m) for m, x in enumerate(xs)]
    two_chunks = session.stats().resident_saved_bytes
    assert session.stats().peak_saved_bytes == two_chunks
    copy_thread.run_now(session.prepare_offload(0, 0))
    released = session.finish_offload(0, 0)
    assert session.stats().resident_saved_bytes == two_chunks - released
    copy_thread.run_now(session.prepare_offload(0, 1))
    released += session.finish_offload(0, 1)
    low = session.stats().resident_saved_bytes
    assert low == two_chunks - released and low > 0
    for m in (1, 0):
        copy_thread.run_now(session.prepare_load(0, m))
        session.finish_load(0, m)
        backward(vjps[m])
        session.release_chunk(0, m)
    stats = session.stats()
    assert stats.peak_saved_bytes == two_chunks and stats.resident_saved_bytes == 0
    assert stats.offloaded_bytes == stats.loaded_bytes > 0


def test_stats_can_be_read_from_another_thread_meanwhile(make_session, copy_thread):
    session = make_session()
    model = _model(True)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: list[int] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                seen.append(session.stats().resident_saved_bytes)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        vjp_fn = _collect(session, model, seeded((16, 32), 1))
        full_round_trip(session, 0, 0, copy_thread)
        backward(vjp_fn)
        session.release_chunk(0, 0)
    finally:
        stop.set()
        thread.join(5)
    assert errors == [] and seen and min(seen) >= 0


# -- integrity checks before and during the copies ----------------------------------------


def _with_handle_on_saved(session):
    """A chunk whose big saved tensor the test can reach (to tamper with it)."""
    w = Parameter(seeded((32, 32), 1, 0.3), name="w")
    x = seeded((64, 32), 2)
    kept: list[Tensor] = []

    def keep(t: Tensor) -> bool:
        kept.append(t)
        return True

    block = swap_wrapper(lambda t: ops.tanh(ops.matmul(t, w)), policy_fn=keep)
    with session.collection_context(0, 0, protected=[x], parameters=[w]):
        _, vjp_fn = ms.vjp(lambda t: block(t).sum(), x, weights=[w])
    group = session.manager.get_group(session.group_name(0, 0))
    saved = next(t for t in kept if tuple(t.shape) == (64, 32))
    return group, saved, vjp_fn


def _refused_offload(session, copy_thread, match):
    """Run the chunk's offload; it must fail with ``match`` and drop no device tensor."""
    job = session.prepare_offload(0, 0)
    copy_thread.run_now(job)
    group = session.manager.get_group(session.group_name(0, 0))
    with pytest.raises(SwapError, match=match):
        session.finish_offload(0, 0)
    moving = [e for e in group.entries() if not e.pinned]
    assert moving and all(e.device is not None for e in moving)  # nothing dropped
    assert {e.state for e in moving} == {SwapState.D2H}


@pytest.mark.parametrize(
    ("check", "write"),
    [
        ("sampled", lambda a: a.__iadd__(1.0)),  # every element: seen by the samples
        ("full", lambda a: a[3].__iadd__(1.0)),  # one row: seen by the full digest
    ],
)
def test_in_place_modification_after_capture_is_refused(make_session, copy_thread, check, write):
    session = make_session(check=check)
    _, saved, vjp_fn = _with_handle_on_saved(session)
    write(saved.asnumpy())  # on CPU asnumpy() is a view: an in-place write
    _refused_offload(session, copy_thread, "modified in place after capture")
    release_forward(vjp_fn)


def test_sampled_check_reads_64_elements_and_can_miss_a_single_one():
    """The documented limit of the default check (docs/swap.md): it reads 64 elements."""
    array = np.arange(4096, dtype=np.float32)
    before = content_digest(array, "sampled")
    array[1] += 1.0  # not one of the 64 evenly spaced samples (0, 65, 130, ...)
    assert content_digest(array, "sampled") == before
    assert content_digest(array, "full") != content_digest(
        np.arange(4096, dtype=np.float32), "full"
    )
    array[65] += 1.0  # a sampled element
    assert content_digest(array, "sampled") != before
    assert DIGEST_SAMPLES == 64


def test_resized_storage_is_refused(make_session, forwards):
    session = make_session()
    _, saved, _ = _with_handle_on_saved(session)
    saved.untyped_storage().resize_(0)  # someone else freed it (another offloader)
    try:
        with pytest.raises(SwapError, match=r"storage changed after capture \(.*nbytes 8192 -> 0"):
            session.prepare_offload(0, 0)
    finally:
        forwards.discard()  # a backward would read the freed storage: it crashes the process


def test_modification_between_launch_and_copy_is_detected(make_session, copy_thread):
    session = make_session()
    _, saved, vjp_fn = _with_handle_on_saved(session)
    job = session.prepare_offload(0, 0)
    saved.asnumpy()[:] = 0.0  # between launch and copy: the copy would be stale
    copy_thread.run_now(job)
    assert isinstance(job.error, SwapError) and copy_thread.errors == [job.error]
    with pytest.raises(SwapError, match="modified in place after capture"):
        session.finish_offload(0, 0)
    release_forward(vjp_fn)


def test_modification_after_the_copy_keeps_the_device_tensor(make_session, copy_thread):
    """A write between the copy and the release would make the host copy stale: the
    compute thread checks once more before it drops the device tensor."""
    session = make_session()
    group, saved, vjp_fn = _with_handle_on_saved(session)
    copy_thread.run_now(session.prepare_offload(0, 0))
    saved.asnumpy()[:] *= 2.0
    with pytest.raises(SwapError, match="modified in place after its copy"):
        session.finish_offload(0, 0)
    assert all(e.device is not None for e in group.entries() if not e.pinned)
    release_forward(vjp_fn)


# -- safety-net timeouts, close and abort -------------------------------------------------


def test_unpack_waits_bounded_for_a_load_that_never_runs(manager, engine, copy_thread):
    session = PipelineSwapSession(
        manager, engine, rank=0, generation=1, eligible={(0, 0)}, wait_timeout_s=0.2
    )
    vjp_fn = _collect(session, _model(), seeded((16, 32), 1))
    copy_thread.run_now(session.prepare_offload(0, 0))
    session.finish_offload(0, 0)
    session.prepare_load(0, 0)  # launched, but never handed to the copy thread
    with pytest.raises(SwapTimeoutError, match=r"did not finish within 0\.2 s"):
        backward(vjp_fn)
    session.abort()
    assert len(manager) == 0 and engine.pool_stats().lent == 0


def test_close_returns_everything_to_baseline(make_session, copy_thread, manager, engine):
    manager.create_group("someone_else", 0, 0, engine=EmulatedDevice())
    session = make_session(eligible={(0, 0), (0, 1)})
    assert session.baseline_groups == 1
    model = _model()
    vjps = [_collect(session, model, seeded((16, 32), m), micro=m) for m in range(2)]
    full_round_trip(session, 0, 1, copy_thread)
    backward(vjps[1])
    session.release_chunk(0, 1)
    copy_thread.run_now(session.prepare_offload(0, 0))
    session.finish_offload(0, 0)  # chunk 0 never consumed: dropped by close
    session.close()
    release_forward(vjps[0])  # its backward finds the chunk closed (and raises)
    stats = session.stats()
    assert stats.live_groups == stats.live_chunks == stats.resident_saved_bytes == 0
    assert manager.group_names() == ("someone_else",)
    assert engine.pool_stats().lent == 0
    with pytest.raises(SwapError, match="closed"):
        session.prepare_load(0, 0)
    session.close()  # idempotent


def test_close_with_a_copy_in_flight_is_a_bug_and_still_cleans(make_session, manager, engine):
    session = make_session()
    vjp_fn = _collect(session, _model(), seeded((16, 32), 1))
    job = session.prepare_offload(0, 0)  # never run
    with pytest.raises(SwapError, match=r"closed with entries in flight: pp_swap_run1_s0_m0/"):
        session.close()
    assert len(manager) == 0 and session.stats().resident_saved_bytes == 0
    assert job.run() == 0  # the queued job was cancelled: a late run does nothing
    assert engine.pool_stats().lent == 0
    release_forward(vjp_fn)


def test_abort_waits_for_running_copies_then_drops(manager, copy_thread):
    slow = GatedDevice()
    session = PipelineSwapSession(manager, slow, rank=0, generation=1, eligible={(0, 0), (0, 1)})
    model = _model()
    vjps = [_collect(session, model, seeded((16, 32), m), micro=m) for m in range(2)]
    slow.d2h_gate.clear()
    running = copy_thread.submit(session.prepare_offload(0, 0))
    queued = session.prepare_offload(0, 1)  # prepared, never submitted
    wait_until(lambda: running.started)
    open_later(slow.d2h_gate)
    session.abort()  # must wait for the running copy, not drop its buffers under it
    assert running.done.is_set() and queued.done.is_set() and queued.run() == 0
    assert len(manager) == 0 and session.stats().resident_saved_bytes == 0
    assert slow.pool_stats().lent == 0
    session.abort()  # idempotent
    for vjp_fn in reversed(vjps):
        release_forward(vjp_fn)


def test_abort_times_out_loudly_and_the_late_copy_cleans_up(manager, copy_thread):
    slow = GatedDevice()
    session = PipelineSwapSession(
        manager, slow, rank=0, generation=1, eligible={(0, 0)}, wait_timeout_s=0.05
    )
    vjp_fn = _collect(session, _model(), seeded((16, 32), 1))
    slow.d2h_gate.clear()  # the copy hangs until the test lets it go
    job = copy_thread.submit(session.prepare_offload(0, 0))
    wait_until(lambda: job.started)
    with pytest.raises(SwapTimeoutError, match=r"abort: 1 copy job\(s\) still running"):
        session.abort()
    assert len(manager) == 0 and session.stats().live_groups == 0
    slow.d2h_gate.set()
    assert job.done.wait(10)
    assert slow.pool_stats().lent == 0  # the job gave its buffers back itself
    release_forward(vjp_fn)


def test_chunk_lifecycle_errors(make_session):
    session = make_session()
    model = _model()
    x = seeded((16, 32), 1)
    vjp_fn = _collect(session, model, x)
    with pytest.raises(SwapError, match="already collected"), session.collection_context(0, 0):
        pass
    for call in (session.prepare_offload, session.finish_load, session.release_chunk):
        with pytest.raises(SwapError, match="not live"):
            call(0, 9)
    with pytest.raises(SwapStateError, match="sealed -> offloaded"):
        session.finish_offload(0, 0)
    backward(vjp_fn)
    session.release_chunk(0, 0)
    with pytest.raises(SwapError, match="not live"):
        session.release_chunk(0, 0)


def test_release_with_a_running_copy_is_refused(manager, copy_thread):
    slow = GatedDevice()
    session = PipelineSwapSession(manager, slow, rank=0, generation=1, eligible={(0, 0)})
    vjp_fn = _collect(session, _model(), seeded((16, 32), 1))
    slow.d2h_gate.clear()
    job = copy_thread.submit(session.prepare_offload(0, 0))
    wait_until(lambda: job.started)
    with pytest.raises(SwapStateError, match="copy job in flight"):
        session.release_chunk(0, 0)
    slow.d2h_gate.set()
    assert job.done.wait(10)
    session.finish_offload(0, 0)
    backward(vjp_fn)  # offloaded, never loaded: the unpack loads it synchronously
    session.release_chunk(0, 0)
    session.close()
    assert slow.pool_stats().lent == 0


def test_the_same_chunk_can_be_collected_again_in_the_next_generation(manager, engine):
    model = _model()
    x = seeded((16, 32), 1)
    for generation in (1, 2):
        session = PipelineSwapSession(
            manager, engine, rank=0, generation=generation, eligible={(0, 0)}
        )
        vjp_fn = _collect(session, model, x)
        assert manager.group_names() == (f"pp_swap_run{generation}_s0_m0",)
        backward(vjp_fn)
        session.release_chunk(0, 0)
        session.close()
    assert len(manager) == 0
    assert np.isfinite(session.stats().peak_saved_bytes)
