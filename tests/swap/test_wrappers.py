"""swap_wrapper / swap_tensor_wrapper: their inputs and what they select."""

from __future__ import annotations

import warnings

import mindspore as ms
import pytest
from mindspore import Parameter, Tensor, nn, ops
from swap_support import MLP, backward, forward, reference_grads, release_forward, seeded

from ppswap.backends.mindspore import SwapWrapperCell
from ppswap.swap import (
    SwapTensor,
    SwapWarning,
    module_state_tensors,
    swap_tensor_wrapper,
    swap_wrapper,
)

# -- bad inputs -----------------------------------------------------------------------------


@pytest.mark.parametrize("module", [None, 3, "dense", [nn.Dense(2, 2)]])
def test_swap_wrapper_rejects_what_cannot_be_called(module):
    with pytest.raises(TypeError, match=r"swap_wrapper\(module_or_callable=...\)"):
        swap_wrapper(module)


@pytest.mark.parametrize("policy", [1, "all", object()])
def test_swap_wrapper_rejects_a_non_callable_policy(policy):
    with pytest.raises(TypeError, match=r"swap_wrapper\(policy_fn=...\)"):
        swap_wrapper(nn.Dense(2, 2), policy_fn=policy)


@pytest.mark.parametrize("flag", [1, 0, None, "yes"])
def test_group_swap_must_be_a_bool(flag):
    with pytest.raises(TypeError, match=r"swap_wrapper\(group_swap=...\)"):
        swap_wrapper(nn.Dense(2, 2), group_swap=flag)
    with pytest.raises(TypeError, match=r"swap_tensor_wrapper\(group_swap=...\)"):
        swap_tensor_wrapper(ops.ones((2,), ms.float32), group_swap=flag)


@pytest.mark.parametrize("tag", [1, b"x", ["t"]])
def test_tag_must_be_str_or_none(tag):
    with pytest.raises(TypeError, match=r"swap_tensor_wrapper\(tag=...\)"):
        swap_tensor_wrapper(ops.ones((2,), ms.float32), tag=tag)


@pytest.mark.parametrize("target", [3, None, "t", {1, 2}])
def test_target_must_be_a_tensor_structure(target):
    with pytest.raises(TypeError, match=r"swap_tensor_wrapper\(target=...\)"):
        swap_tensor_wrapper(target)


def test_tensor_wrapper_outside_a_context_warns_and_returns_target():
    target = (ops.ones((2,), ms.float32), {"k": [ops.zeros((3,), ms.float32)]}, 7)
    with pytest.warns(SwapWarning, match="outside any swap collection context"):
        out = swap_tensor_wrapper(target, tag="any string is fine")
    assert out is target


def test_tensor_wrapper_in_an_unselected_chunk_is_silent(make_session):
    session = make_session(eligible=())
    x = ops.ones((2,), ms.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with session.collection_context(0, 0):
            assert swap_tensor_wrapper(x, tag="t") is x
    session.release_chunk(0, 0)


def test_policy_errors_propagate(make_session):
    def policy(t: Tensor) -> bool:
        raise LookupError("policy broke")

    block = swap_wrapper(lambda x: ops.sin(x), policy_fn=policy)
    session = make_session()
    x = seeded((4,), 1)
    with pytest.raises(LookupError, match="policy broke"), session.collection_context(0, 0):
        ms.vjp(lambda t: block(t * 2).sum(), x)


def test_policy_must_return_a_bool(make_session):
    block = swap_wrapper(lambda x: ops.sin(x), policy_fn=lambda t: 1)
    session = make_session()
    with (
        pytest.raises(TypeError, match="policy_fn must return a bool"),
        session.collection_context(0, 0),
    ):
        ms.vjp(lambda t: block(t * 2).sum(), seeded((4,), 1))


# -- what the wrappers select ---------------------------------------------------------------


def test_cell_wrapper_keeps_parameters_and_order():
    model = MLP(blocks=2)
    before = model.trainable_params()
    for i in range(2):
        model.layers[i] = swap_wrapper(model.layers[i])
    assert isinstance(model.layers[0], SwapWrapperCell)
    after = model.trainable_params()
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before, strict=True))


def test_cell_wrapper_outside_a_context_is_transparent():
    model = MLP(blocks=2)
    x = seeded((4, 16), 1)
    expected = model(x).asnumpy()
    for i in range(2):
        model.layers[i] = swap_wrapper(model.layers[i])
    assert model(x).asnumpy().tobytes() == expected.tobytes()


class _KwargCell(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(4, 4)

    def construct(self, x: Tensor, scale: float = 1.0) -> Tensor:
        return ops.tanh(self.dense(x)) * scale


def test_cell_wrapper_forwards_keyword_arguments(make_session):
    cell = swap_wrapper(_KwargCell())
    session = make_session()
    x = seeded((2, 4), 2)
    with session.collection_context(0, 0, parameters=cell.trainable_params()):
        out = cell(x, scale=2.0)
    assert out.shape == (2, 4)


def test_callable_wrapper_keeps_name_and_captures(make_session):
    def block(x: Tensor) -> Tensor:
        return ops.tanh(x * 3)

    wrapped = swap_wrapper(block)
    assert wrapped.__name__ == "block"
    session = make_session()
    x = seeded((8,), 3)
    with session.collection_context(0, 0, protected=[x]):
        _, vjp_fn = ms.vjp(lambda t: wrapped(t).sum(), x)
    group = session.manager.get_group(session.group_name(0, 0))
    selected = [e for e in group.entries() if e.selected]
    assert selected and all(e.tag.startswith("test_callable_wrapper") for e in selected)
    release_forward(vjp_fn)


def test_policy_false_keeps_a_tensor_on_device(make_session, copy_thread):
    seen_shapes: list[tuple[int, ...]] = []

    def only_wide(t: Tensor) -> bool:
        seen_shapes.append(tuple(t.shape))
        return t.shape[-1] > 8

    w1 = Parameter(seeded((8, 16), 1, 0.3), name="w1")
    w2 = Parameter(seeded((16, 8), 2, 0.3), name="w2")
    block = swap_wrapper(
        lambda x: ops.tanh(ops.matmul(ops.tanh(ops.matmul(x, w1)), w2)), policy_fn=only_wide
    )
    x = seeded((4, 8), 3)
    fn = lambda t: block(t).sum()  # noqa: E731
    expected = reference_grads(fn, x, [w1, w2])
    session = make_session()
    with session.collection_context(0, 0, protected=[x], parameters=[w1, w2]):
        _, vjp_fn = forward(fn, x, [w1, w2])
    group = session.manager.get_group(session.group_name(0, 0))
    assert (8, 16) not in seen_shapes and (16, 8) not in seen_shapes  # params: not asked
    assert any(s[-1] <= 8 for s in seen_shapes)
    for entry in group.entries():
        assert entry.pinned is (entry.key.shape[-1] <= 8)
    copy_thread.run_now(session.prepare_offload(0, 0))
    session.finish_offload(0, 0)
    assert session.stats().resident_saved_bytes > 0  # the narrow ones stayed, counted
    copy_thread.run_now(session.prepare_load(0, 0))
    session.finish_load(0, 0)
    assert [g.tobytes() for g in backward(vjp_fn)] == [g.tobytes() for g in expected]
    session.release_chunk(0, 0)


def test_parameters_and_module_tensors_are_never_captured(make_session):
    """Even without the session's parameters= list, the wrapper knows its own state."""

    class WithTable(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Dense(6, 6)
            self.table = seeded((6,), 4)

        def construct(self, x: Tensor) -> Tensor:
            return ops.tanh(self.dense(x) * self.table)

    cell = WithTable()
    state = module_state_tensors(cell)
    assert any(t is cell.table for t in state) and len(state) == 3
    wrapped = swap_wrapper(cell)
    session = make_session()
    x = seeded((3, 6), 5)
    with session.collection_context(0, 0, protected=[x]):  # no parameters= on purpose
        _, vjp_fn = ms.vjp(lambda t: wrapped(t).sum(), x, weights=cell.trainable_params())
    group = session.manager.get_group(session.group_name(0, 0))
    owned = {t.untyped_storage().data_ptr() for t in state}
    assert group.entries() and not {e.key.storage_ptr for e in group.entries()} & owned
    release_forward(vjp_fn)


def test_registration_before_and_after_the_save(make_session, copy_thread):
    """tanh saves its output y before y is registered; sin saves it after."""
    w = Parameter(seeded((8, 8), 1, 0.3), name="w")
    x = seeded((4, 8), 2)

    def fn(t: Tensor) -> Tensor:
        y = ops.tanh(ops.matmul(t, w))
        assert swap_tensor_wrapper(y, tag="y", group_swap=True) is y
        return ops.sin(y).sum()

    with pytest.warns(SwapWarning):  # the reference run has no collection context
        expected = reference_grads(fn, x, [w])
    session = make_session()
    with session.collection_context(0, 0, protected=[x], parameters=[w]):
        _, vjp_fn = forward(fn, x, [w])
    group = session.manager.get_group(session.group_name(0, 0))
    selected = [e for e in group.entries() if e.selected]
    assert [e.key.shape for e in selected] == [(4, 8)] and selected[0].bulk
    assert isinstance(selected[0], SwapTensor) and not selected[0].pinned
    copy_thread.run_now(session.prepare_offload(0, 0))
    session.finish_offload(0, 0)
    copy_thread.run_now(session.prepare_load(0, 0))
    session.finish_load(0, 0)
    assert [g.tobytes() for g in backward(vjp_fn)] == [g.tobytes() for g in expected]
    session.release_chunk(0, 0)


def test_registered_parameters_are_ignored(make_session):
    w = Parameter(seeded((4,), 1), name="w")
    session = make_session()
    with session.collection_context(0, 0):
        swap_tensor_wrapper(w)
        _, vjp_fn = ms.vjp(lambda t: ops.sin(t * w).sum(), seeded((4,), 2), weights=[w])
    group = session.manager.get_group(session.group_name(0, 0))
    on_w = [e for e in group.entries() if e.key.storage_ptr == w.untyped_storage().data_ptr()]
    assert on_w and all(not e.selected and e.pinned for e in on_w)
    release_forward(vjp_fn)
