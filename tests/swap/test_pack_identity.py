"""The pack function's identity shortcut (``ppswap.swap.packing``) on torch, whose saved
tensors arrive as the same Python objects when one tensor is saved twice: a second save
gets the first handle back only where a new look could not change it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ppswap.backends.torch import BACKEND as TORCH  # noqa: E402
from ppswap.swap import EmulatedDevice, PipelineSwapSession, SwapManager, swap_wrapper  # noqa: E402


def session_of(manager: SwapManager) -> PipelineSwapSession:
    return PipelineSwapSession(
        manager, EmulatedDevice(), rank=0, generation=0, eligible={(0, 0)}, wait_timeout_s=5
    )


def grads_of(fn, x: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_(True)
    out = fn(x)
    return list(torch.autograd.grad(out, [x, weight]))


def round_trip(session: PipelineSwapSession, out: torch.Tensor, leaves: list[torch.Tensor]):
    session.protect_aliases(0, 0, [out])
    session.prepare_offload(0, 0).run()
    session.finish_offload(0, 0)
    session.prepare_load(0, 0).run()
    session.finish_load(0, 0)
    grads = torch.autograd.grad(out, leaves)
    session.release_chunk(0, 0)
    session.close()
    return list(grads)


def test_a_tensor_saved_outside_a_region_then_inside_one_is_selected_and_moves():
    """``y`` is saved first by an op outside every region (an unselected entry), then by a
    swap_wrapper region: the second save must select it, so it moves. A shortcut that
    handed back the unselected entry would leave it pinned on device."""
    torch.manual_seed(0)
    weight = torch.randn(16, 16, requires_grad=True)
    region = swap_wrapper(lambda t: torch.tanh(t @ weight))

    saved: list[torch.Tensor] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = torch.exp(x * 0.1)  # exp saves its output y: outside any region
        saved.append(y)
        return region(y).sum()  # the matmul saves y again, in the region

    x = torch.randn(32, 16)
    expected = grads_of(fn, x, weight)
    manager = SwapManager(TORCH)
    session = session_of(manager)
    leaf = x.detach().requires_grad_(True)
    with session.collection_context(0, 0, parameters=[weight]):
        out = fn(leaf)
    group = manager.get_group(session.group_name(0, 0))
    (y_entry,) = [e for e in group.entries() if e.device is saved[-1]]
    assert y_entry.selected and not y_entry.pinned
    moved = {id(span) for span in group.spans()}
    assert y_entry.span is not None and id(y_entry.span) in moved
    got = round_trip(session, out, [leaf, weight])
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


def test_a_tensor_saved_twice_in_a_region_is_one_entry_and_bit_identical():
    """The next layer saves the tanh output its producer saved: one entry per output,
    each moved, and the gradients after a round trip equal swap off's."""
    torch.manual_seed(1)
    layers = torch.nn.Sequential(
        *[
            swap_wrapper(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()))
            for _ in range(3)
        ]
    )
    params = list(layers.parameters())
    x = torch.randn(8, 16)
    expected = list(torch.autograd.grad(layers(x).sum(), params))
    manager = SwapManager(TORCH)
    session = session_of(manager)
    with session.collection_context(0, 0, protected=[x], parameters=params):
        out = layers(x).sum()
    group = manager.get_group(session.group_name(0, 0))
    # three tanh outputs: each saved by its Tanh and (but the last) by the next Linear
    assert len(group) == 3
    assert all(e.selected and not e.pinned for e in group.entries())
    got = round_trip(session, out, params)
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


def test_a_protected_tensor_saved_twice_stays_resident_and_counted_once():
    torch.manual_seed(2)
    weight = torch.randn(16, 16, requires_grad=True)
    region = swap_wrapper(lambda t: torch.tanh(t @ weight) * t)
    x = torch.randn(32, 16).requires_grad_(True)
    manager = SwapManager(TORCH)
    session = session_of(manager)
    with session.collection_context(0, 0, protected=[x], parameters=[weight]):
        ledger = session._chunks[(0, 0)]
        out = region(x).sum()  # x saved by the matmul and by the product
    held = list(ledger.resident.values())
    assert len(held) == 1 and held[0] is x  # the ledger holds x once
    group = manager.get_group(session.group_name(0, 0))
    assert all(e.shape != (32, 16) or e.device is not x for e in group.entries())
    assert session.stats().resident_saved_bytes >= x.untyped_storage().nbytes()
    round_trip(session, out, [x, weight])
