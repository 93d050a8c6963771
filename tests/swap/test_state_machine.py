"""The state machine of Storage/SwapTensor, the phases of a group, and CopyJob's life."""

from __future__ import annotations

import itertools
import threading
import weakref

import mindspore as ms
import pytest
from cyclic_garbage import collector_off
from mindspore import ops
from swap_support import GatedDevice, seeded, wait_until

from ppswap.backends.mindspore import BACKEND as MINDSPORE
from ppswap.swap import CopyJob, EmulatedDevice, Storage, SwapError, SwapState, SwapStateError
from ppswap.swap.group import GroupPhase, SwapGroup
from ppswap.swap.jobs import JobKind, JobPhase
from ppswap.swap.tensor import LEGAL_TRANSITIONS

CYCLE = [SwapState.DEVICE, SwapState.D2H, SwapState.HOST, SwapState.H2D, SwapState.DEVICE]


def _storage(tag: str = "act") -> Storage:
    return Storage(group="g1", tag=tag, nbytes=4, shape=(1,), dtype=ms.float32)


def _storage_in(state: SwapState) -> Storage:
    storage = _storage()
    for target in CYCLE[1 : CYCLE.index(state) + 1]:
        storage.transition(target)
    assert storage.state is state
    return storage


def test_the_legal_cycle_can_repeat():
    storage = _storage()
    for _ in range(2):
        for before, after in itertools.pairwise(CYCLE):
            assert storage.transition(after) is before
    assert storage.state is SwapState.DEVICE


ILLEGAL = [(a, b) for a in SwapState for b in SwapState if LEGAL_TRANSITIONS[a] is not b]


def test_exactly_four_moves_are_legal():
    assert len(ILLEGAL) == 12
    assert {(a, LEGAL_TRANSITIONS[a]) for a in SwapState} == set(itertools.pairwise(CYCLE))


@pytest.mark.parametrize(("current", "target"), ILLEGAL, ids=lambda s: s.name)
def test_every_illegal_move_raises_and_names_everything(current, target):
    storage = _storage_in(current)
    with pytest.raises(SwapStateError) as info:
        storage.transition(target)
    err = info.value
    message = str(err)
    assert "'g1'" in message and "'act'" in message
    assert f"{current.name} -> {target.name}" in message
    assert (err.group, err.tag, err.from_state, err.to_state) == ("g1", "act", current, target)
    assert storage.state is current  # nothing moved
    assert isinstance(err, SwapError) and isinstance(err, RuntimeError)


def test_a_released_storage_cannot_move():
    storage = _storage()
    storage.released = True
    with pytest.raises(SwapStateError, match="released -> D2H"):
        storage.transition(SwapState.D2H)


def test_concurrent_transitions_admit_exactly_one_winner():
    storages = [_storage(f"t{i}") for i in range(200)]
    wins: list[int] = []
    barrier = threading.Barrier(4)

    def race() -> None:
        barrier.wait()
        for storage in storages:
            try:
                storage.transition(SwapState.D2H)
                wins.append(1)
            except SwapStateError:
                pass

    threads = [threading.Thread(target=race) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(wins) == len(storages)


def test_swap_tensor_transitions_through_its_group(manager, engine, copy_thread):
    group = manager.create_group("g2", 0, 0, engine=EmulatedDevice())
    entry = group.register(ops.ones((4,), ms.float32) * 3, tag="x")
    assert entry.state is SwapState.DEVICE and entry.group == "g2" and entry.nbytes == 16
    with pytest.raises(SwapStateError, match=r"'g2'.*'x'.*DEVICE -> HOST"):
        entry.transition(SwapState.HOST)
    assert "DEVICE" in repr(entry)


def test_an_entry_outliving_its_released_group_frees_it_and_refuses_to_load(manager, copy_thread):
    """An entry refers to its group weakly: once the group is released and dropped (the
    graph may still hold the entry), reference counting frees the group, with the
    collector off, and the entry's unpack raises instead of loading."""
    group = manager.create_group("gone", 0, 0, engine=EmulatedDevice())
    entry = group.register(seeded((8,), 4) * 2, tag="kept")
    group.seal()
    copy_thread.run_now(group.prepare_offload())
    group.finish_offload()
    assert entry.state is SwapState.HOST
    freed = weakref.ref(manager.remove_group("gone"))
    with collector_off():
        freed().release()
        del group
        assert freed() is None
    with pytest.raises(SwapStateError, match=r"'gone'.*'kept'.*no longer exists"):
        entry.materialize()


def test_entry_tags_are_unique_in_a_group(manager, engine):
    """A repeated tag gets the smallest free ``#n``, also around tags given as ``tag#n``."""
    group = manager.create_group("tags", 0, 0, engine=EmulatedDevice())
    tags = [
        group.register(seeded((4,), i) * 2, tag=tag).tag
        for i, tag in enumerate(["a", "a", "a#2", "a", "b", "a", "b", None])
    ]
    assert tags == ["a", "a#1", "a#2", "a#3", "b", "a#4", "b#1", "t7"]
    group.release()


def test_group_phases_are_enforced(manager, engine, copy_thread):
    group = manager.create_group("phases", 1, 2, engine=EmulatedDevice())
    group.register(seeded((8,), 1) * 2, tag="a")
    with pytest.raises(SwapStateError, match="collecting -> offload_prepared"):
        group.prepare_offload()
    group.seal()
    with pytest.raises(SwapStateError, match=r"'phases'.*sealed -> collecting"):
        group.register(seeded((8,), 2) * 2, tag="late")
    with pytest.raises(SwapStateError, match="sealed -> offloaded"):
        group.finish_offload()
    job = group.prepare_offload()
    with pytest.raises(SwapStateError, match="offload_prepared -> load_prepared"):
        group.prepare_load()
    with pytest.raises(SwapStateError, match=r"D2H -> HOST \(the offload copy has not run"):
        group.finish_offload()
    copy_thread.run_now(job)
    group.finish_offload()
    load = group.prepare_load()
    with pytest.raises(SwapStateError, match=r"H2D -> DEVICE \(the load copy has not run"):
        group.finish_load()
    copy_thread.run_now(load)
    group.finish_load()
    assert group.phase is GroupPhase.LOADED
    group.release()
    assert group.phase is GroupPhase.RELEASED
    group.release()  # idempotent


def test_release_refuses_while_a_copy_runs(manager, copy_thread):
    slow = GatedDevice()
    slow.d2h_gate.clear()
    group = manager.create_group("busy", 0, 0, engine=slow)
    group.register(seeded((64, 256), 3) * 1.5, tag="big")
    group.seal()
    job = copy_thread.submit(group.prepare_offload())
    wait_until(lambda: job.started)
    with pytest.raises(SwapStateError, match="copy job in flight"):
        group.release()
    slow.d2h_gate.set()
    assert job.done.wait(10)
    group.release()
    assert slow.pool_stats().lent == 0


def test_bad_group_arguments():
    def group(name: str, stage: object, micro: object, **kwargs: object) -> SwapGroup:
        return SwapGroup(name, stage, micro, backend=MINDSPORE, engine=EmulatedDevice(), **kwargs)  # type: ignore[arg-type]

    with pytest.raises(TypeError, match="name"):
        group("", 0, 0)
    with pytest.raises(ValueError, match="stage"):
        group("g", -1, 0)
    with pytest.raises(TypeError, match="micro"):
        group("g", 0, "3")
    with pytest.raises(TypeError, match="group_swap"):
        group("g", 0, 0, group_swap=1)
    with pytest.raises(ValueError, match="bucket_bytes"):
        group("g", 0, 0, bucket_bytes=64 * 1024 * 1024)
    with pytest.raises(ValueError, match="wait_timeout_s"):
        group("g", 0, 0, wait_timeout_s=0)
    with pytest.raises(ValueError, match="check must be one of sampled, full"):
        group("g", 0, 0, check="none")


# -- CopyJob ------------------------------------------------------------------------------


def _job(work=None, on_cancel=None) -> CopyJob:
    return CopyJob(kind=JobKind.OFFLOAD, group="g", nbytes=10, work=work, on_cancel=on_cancel)


def test_job_runs_once():
    calls: list[int] = []
    job = _job(lambda: calls.append(1))
    assert job.run() == 10 and job.done.is_set() and job.finished
    with pytest.raises(SwapStateError, match=r"'g'.*'<offload job>'.*done -> running"):
        job.run()
    assert calls == [1]


def test_empty_job_moves_nothing():
    job = CopyJob.empty(JobKind.LOAD, "g")
    assert job.nbytes == 0 and job.run() == 0 and job.done.is_set()


def test_cancelled_job_is_a_noop_and_releases():
    released: list[int] = []
    job = _job(lambda: pytest.fail("must not run"), on_cancel=lambda: released.append(1))
    assert job.cancel() is True
    assert job.done.is_set() and job.phase is JobPhase.CANCELLED and released == [1]
    assert job.run() == 0
    assert job.cancel() is False


def test_started_job_cannot_be_cancelled():
    gate = threading.Event()
    job = _job(lambda: gate.wait(5))
    runner = threading.Thread(target=job.run)
    runner.start()
    wait_until(lambda: job.started)
    assert job.cancel() is False
    gate.set()
    runner.join(5)
    assert job.finished


def test_job_error_is_kept_and_reraised():
    def boom() -> None:
        raise OSError("disk on fire")

    job = _job(boom)
    with pytest.raises(OSError, match="disk on fire"):
        job.run()
    assert job.done.is_set() and isinstance(job.error, OSError)


def test_job_wait_times_out_with_a_clear_error():
    job = _job(lambda: None)
    with pytest.raises(SwapError, match=r"did not finish within 0.05 s \(phase new\)"):
        job.wait(0.05)
