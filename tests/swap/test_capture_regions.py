"""swap_wrapper regions under the collection's own hooks (``Collection.region``) and,
where the collection installed none, under hooks of their own: the same captures."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import pytest
from mindspore import Tensor, ops
from swap_support import backward, forward, reference_grads, seeded

from ppswap.backends.mindspore import BACKEND as MINDSPORE
from ppswap.swap import SwapTensor, swap_wrapper
from ppswap.swap.errors import SwapError
from ppswap.swap.manager import Collection, current_collection
from ppswap.swap.wrappers import capture_scope


def nested_blocks() -> Callable[[Tensor], Tensor]:
    """An outer region (no policy) around an inner one whose policy refuses everything,
    with a save in the outer region after the inner returned."""
    inner = swap_wrapper(lambda t: ops.tanh(t * 2), policy_fn=lambda t: False)

    def outer_block(t: Tensor) -> Tensor:
        first = ops.sin(t * 3)  # the outer region's
        return ops.exp(inner(first) * 0.5)  # inner's tanh, then the outer's exp again

    outer = swap_wrapper(outer_block)
    return lambda x: ops.cos(outer(x) * 2).sum()  # the cos: outside every region


def captured(entries: Iterable[SwapTensor]) -> list[tuple[str, bool]]:
    """Each entry's tag (without its ``#n``) and whether it was selected."""
    return sorted((e.tag.split("#")[0], e.selected) for e in entries)


@pytest.mark.parametrize("own_hooks", [True, False], ids=["collection-hooks", "region-hooks"])
def test_nested_regions_capture_as_the_innermost_region_says(
    make_session, manager, engine, own_hooks
):
    fn = nested_blocks()
    x = seeded((4, 8), 3)
    expected = reference_grads(fn, x, [])
    if own_hooks:
        session = make_session()
        scope: AbstractContextManager[object] = session.collection_context(0, 0, protected=[x])
        name = session.group_name(0, 0)
    else:
        name = "standalone"
        manager.create_group(name, 0, 0, engine=engine)
        scope = manager.collecting(name)
    with scope:
        collection = current_collection()
        assert collection is not None and collection.hooks_active is own_hooks
        _, vjp_fn = forward(fn, x, [])
    entries = captured(manager.get_group(name).entries())
    # sin and exp saved in the outer region: selected, tagged with its label; the inner
    # region's tanh: refused by its policy; the cos outside every region: not selected
    # (the collection's hook, where it has one), or not captured at all.
    outer = [selected for tag, selected in entries if tag.endswith("outer_block")]
    inner = [selected for tag, selected in entries if tag.endswith("<lambda>")]
    assert outer and all(outer)
    assert inner and not any(inner)
    outside = [selected for tag, selected in entries if tag == "registered"]
    assert not any(outside) and (bool(outside) is own_hooks)
    assert [g.tobytes() for g in backward(vjp_fn)] == [g.tobytes() for g in expected]


def test_a_region_that_raises_restores_the_outer_one():
    collection = Collection(MINDSPORE, group=None)
    outside = collection._region
    with pytest.raises(ValueError), collection.region(None, None, "failing"):
        assert collection._region == (True, None, None, "failing")
        raise ValueError("the region's forward failed")
    assert collection._region == outside
    collection.close()
    with pytest.raises(SwapError, match="after its chunk's forward ended"):
        collection.region(None, None, "late")


def test_the_hooks_flag_is_set_only_inside_capture_scope():
    collection = Collection(MINDSPORE, group=None)
    with capture_scope(collection):
        assert collection.hooks_active
    assert not collection.hooks_active
    collection.close()
