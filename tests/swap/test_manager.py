"""SwapManager: groups by name, no singleton; the collection context in a ContextVar."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ppswap.backends.mindspore import BACKEND as MINDSPORE
from ppswap.swap import EmulatedDevice, SwapError, SwapManager
from ppswap.swap.manager import Collection, activate, current_collection


def test_groups_by_name(manager):
    assert manager.group_names() == () and len(manager) == 0
    a = manager.create_group("a", 0, 0, engine=EmulatedDevice())
    b = manager.create_group("b", 1, 3, engine=EmulatedDevice(), group_swap=True)
    assert manager.group_names() == ("a", "b") and len(manager) == 2
    assert manager.get_group("b") is b and b.chunk == (1, 3) and b.group_swap
    assert "a" in manager and "zzz" not in manager
    assert manager.remove_group("a") is a
    assert manager.group_names() == ("b",)
    with pytest.raises(KeyError, match=r"no swap group named 'a'; live: \['b'\]"):
        manager.get_group("a")
    with pytest.raises(KeyError, match="'a'"):
        manager.remove_group("a")


def test_a_name_in_use_is_refused(manager):
    manager.create_group("pp_swap_run1_s0_m0", 0, 0, engine=EmulatedDevice())
    with pytest.raises(SwapError, match="'pp_swap_run1_s0_m0' already exists"):
        manager.create_group("pp_swap_run1_s0_m0", 0, 0, engine=EmulatedDevice())


def test_managers_are_independent():
    first, second = SwapManager(MINDSPORE), SwapManager(MINDSPORE)
    first.create_group("g", 0, 0, engine=EmulatedDevice())
    assert second.group_names() == ()
    second.create_group("g", 0, 0, engine=EmulatedDevice())  # same name, other rank: no clash


def test_nested_contexts_restore_the_outer_one(manager):
    outer = Collection(
        MINDSPORE, group=manager.create_group("outer", 0, 0, engine=EmulatedDevice())
    )
    inner = Collection(
        MINDSPORE, group=manager.create_group("inner", 0, 1, engine=EmulatedDevice())
    )
    assert current_collection() is None
    with activate(outer):
        assert current_collection() is outer
        with activate(inner):
            assert current_collection() is inner
            with activate(None):
                assert current_collection() is None
            assert current_collection() is inner
        assert current_collection() is outer
    assert current_collection() is None


def test_context_restored_after_an_exception(manager):
    outer = Collection(MINDSPORE, group=None)
    with activate(outer):
        with pytest.raises(RuntimeError), activate(Collection(MINDSPORE, group=None)):
            raise RuntimeError("forward failed")
        assert current_collection() is outer


def test_threads_do_not_see_each_others_context(manager):
    seen: dict[str, object] = {}
    ready, release = threading.Event(), threading.Event()
    mine = Collection(MINDSPORE, group=manager.create_group("t", 0, 0, engine=EmulatedDevice()))

    def other() -> None:
        seen["before"] = current_collection()
        theirs = Collection(MINDSPORE, group=None)
        with activate(theirs):
            ready.set()
            release.wait(5)
            seen["inside"] = current_collection() is theirs

    with activate(mine):
        thread = threading.Thread(target=other)
        thread.start()
        assert ready.wait(5)
        assert current_collection() is mine  # the other thread's activate is invisible
        release.set()
        thread.join(5)
    assert seen == {"before": None, "inside": True}


def test_tasks_do_not_see_each_others_context(manager):
    async def main() -> list[bool]:
        collections = [Collection(MINDSPORE, group=None) for _ in range(3)]
        gate = asyncio.Event()

        async def task(i: int) -> bool:
            with activate(collections[i]):
                await gate.wait()  # all three are active at the same time
                await asyncio.sleep(0)
                return current_collection() is collections[i]

        tasks = [asyncio.create_task(task(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        gate.set()
        results = await asyncio.gather(*tasks)
        assert current_collection() is None
        return results

    assert asyncio.run(main()) == [True, True, True]


def test_collecting_targets_a_named_group(manager):
    group = manager.create_group("standalone", 0, 0, engine=EmulatedDevice())
    with manager.collecting("standalone") as collection:
        assert current_collection() is collection and collection.group is group
    assert current_collection() is None
    assert group.phase.value == "sealed"


def test_a_closed_collection_refuses_a_new_capture_region():
    """A collection's regions share its pack function, which close() drops (it refers to
    the collection): a region entered after the forward ended is refused, naming why."""
    collection = Collection(MINDSPORE, group=None)
    collection.pack_hook(capture=True)  # a region during the forward
    collection.close()
    with pytest.raises(SwapError, match="after its chunk's forward ended"):
        collection.pack_hook(capture=True)
