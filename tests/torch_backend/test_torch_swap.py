"""The swap layer on torch tensors, one chunk at a time: what is captured, how it comes
back, and what is refused.

A chunk is collected in a real ``PipelineSwapSession`` (torch backend, CPU copy engine)
around ``TORCH.autograd.record``; its copy jobs run on the test's thread; its backward is
``TORCH.autograd.backward``. References are the same forward and backward without any
session.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from torch import nn
from torch_support import DIM, AttentionBlock, MLPBlock, StageModel, build_modules, make_data

from ppswap.backends.autograd import ForwardRecord
from ppswap.backends.cpu_engine import contiguous_strides
from ppswap.backends.torch import BACKEND as TORCH
from ppswap.backends.torch import SwapWrapperModule
from ppswap.backends.torch.hooks import SavedTensorModifiedError
from ppswap.swap import (
    EmulatedDevice,
    PipelineSwapSession,
    SwapError,
    SwapManager,
    SwapState,
    SwapWarning,
    swap_tensor_wrapper,
    swap_wrapper,
)

Loss = Callable[[torch.Tensor], torch.Tensor]


@pytest.fixture
def session() -> Iterator[PipelineSwapSession]:
    """A session of the torch backend in which chunk (0, 0) is eligible for swap."""
    made = PipelineSwapSession(
        SwapManager(TORCH),
        EmulatedDevice(),
        rank=0,
        generation=1,
        eligible={(0, 0)},
        wait_timeout_s=10.0,
    )
    yield made
    made.abort()


def _seeded(module: nn.Module, seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for param in module.parameters():
            param.data.normal_(0.0, 0.3)
    return module


def _input(rows: int = 2) -> torch.Tensor:
    return torch.from_numpy(make_data()[0][:rows].copy())


def _record(fn: Loss, x: torch.Tensor) -> ForwardRecord:
    _, record = TORCH.autograd.record(fn, [x])
    return record


def _backward(record: ForwardRecord, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    dx, dw = TORCH.autograd.backward(record, torch.tensor(1.0), params)
    assert dx[0] is not None
    return [dx[0], *dw]


def _collect(
    session: PipelineSwapSession, fn: Loss, x: torch.Tensor, params: Sequence[torch.Tensor]
) -> ForwardRecord:
    with session.collection_context(0, 0, protected=[x], parameters=params):
        out, record = TORCH.autograd.record(fn, [x])
    session.protect_aliases(0, 0, [out])
    return record


def _round_trip(session: PipelineSwapSession) -> None:
    session.prepare_offload(0, 0).run()
    session.finish_offload(0, 0)
    session.prepare_load(0, 0).run()
    session.finish_load(0, 0)


def _moving(session: PipelineSwapSession) -> list:  # type: ignore[type-arg]
    group = session.manager.get_group(session.group_name(0, 0))
    return [e for e in group.entries() if not e.pinned]


def _loss_of(module: nn.Module) -> Loss:
    def loss(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = module(x)
        return out.pow(2).mean()

    return loss


# -- strided views ----------------------------------------------------------------------------


@pytest.mark.parametrize("group_swap", [False, True], ids=["per-tensor", "bucketed"])
def test_strided_saved_views_come_back_with_their_strides_bit_identical(
    session: PipelineSwapSession, group_swap: bool
) -> None:
    """The attention block saves k transposed and q, k, v at offsets of one storage. They
    are offloaded (device references dropped), loaded back laid out with the original
    shape, strides and dtype, and the backward is bit-identical to one without swap; with
    ``group_swap`` (one host bucket per group) too."""
    block = swap_wrapper(_seeded(AttentionBlock()), group_swap=group_swap)
    params = list(block.parameters())
    x = _input()
    expected = _backward(_record(_loss_of(block), x), params)

    record = _collect(session, _loss_of(block), x, params)
    moving = _moving(session)
    keys = [e.key for e in moving]
    assert any(k.strides != contiguous_strides(k.shape) for k in keys), keys
    assert any(k.offset > 0 for k in keys), keys
    assert all(e.bulk is group_swap for e in moving)

    session.prepare_offload(0, 0).run()
    session.finish_offload(0, 0)
    assert all(e.state is SwapState.HOST and e.device is None for e in moving)
    assert session.stats().offloaded_bytes == sum(e.nbytes for e in moving)
    session.prepare_load(0, 0).run()
    session.finish_load(0, 0)
    for entry in moving:
        restored = entry.device
        assert isinstance(restored, torch.Tensor)
        assert tuple(restored.shape) == entry.key.shape
        assert tuple(restored.stride()) == entry.key.strides
        assert str(restored.dtype) == entry.key.dtype

    got = _backward(record, params)
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    session.release_chunk(0, 0)


# -- what the wrappers select ----------------------------------------------------------------


class _Tagged(nn.Module):
    """Registers its hidden activation with swap_tensor_wrapper after tanh saved it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 16)
        self.fc2 = nn.Linear(16, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.fc1(x))
        assert swap_tensor_wrapper(hidden, tag="hidden") is hidden
        return torch.sin(self.fc2(hidden))


def test_swap_tensor_wrapper_captures_a_tensor_of_a_torch_forward(
    session: PipelineSwapSession,
) -> None:
    """Inside a plain (unwrapped) module's forward, swap_tensor_wrapper selects exactly the
    registered activation (saved by tanh before the call and by fc2 after it): only its
    bytes move, and the backward is bit-identical."""
    model = _seeded(_Tagged())
    params = list(model.parameters())
    x = torch.from_numpy(make_data()[0][:, 0, :].copy())  # (batch, DIM)
    with pytest.warns(SwapWarning, match="outside any swap collection context"):
        expected = _backward(_record(_loss_of(model), x), params)

    record = _collect(session, _loss_of(model), x, params)
    group = session.manager.get_group(session.group_name(0, 0))
    selected = [e for e in group.entries() if e.selected]
    # One entry (both saves are the same view). Its tag is the outer hook's "registered":
    # the entry was made when tanh saved it, before swap_tensor_wrapper named it.
    assert len(selected) == 1
    assert selected[0].key.shape == (x.shape[0], 16) and not selected[0].pinned
    assert any(e.pinned for e in group.entries())  # fc2's output, saved by sin: not chosen

    _round_trip(session)
    assert session.stats().offloaded_bytes == x.shape[0] * 16 * 4
    got = _backward(record, params)
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    session.release_chunk(0, 0)


def test_swap_wrapper_keeps_the_parameters_and_is_transparent_outside_a_run() -> None:
    """swap_wrapper on torch modules: a SwapWrapperModule exposing the same parameter
    objects in the same order (names gain ``module.``), computing bit-identical outputs."""
    (plain,) = build_modules(1, wrap=False)
    (wrapped,) = build_modules(1, wrap=False)
    before = list(wrapped.parameters())
    names = [name for name, _ in wrapped.named_parameters()]
    for index, block in enumerate(wrapped.blocks):
        wrapped.blocks[index] = swap_wrapper(block)
    assert all(isinstance(b, SwapWrapperModule) for b in wrapped.blocks)
    after = list(wrapped.parameters())
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before, strict=True))
    renamed = [name for name, _ in wrapped.named_parameters()]
    assert renamed == [re.sub(r"^blocks\.(\d+)\.", r"blocks.\1.module.", n) for n in names]
    x = _input()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no swap warning outside a collection
        assert torch.equal(wrapped(x), plain(x))


def test_stage_model_wraps_every_block() -> None:
    """The model the pipeline tests use really is swap-wrapped (else swap moves nothing)."""
    model = StageModel()
    assert [type(b) for b in model.blocks] == [SwapWrapperModule, SwapWrapperModule]
    assert [type(b.module) for b in model.blocks] == [AttentionBlock, MLPBlock]


# -- in-place modification of a saved tensor ---------------------------------------------------


class _Square(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.fc(x))
        return hidden * hidden


def _with_handle_on_saved(
    session: PipelineSwapSession,
) -> tuple[ForwardRecord, torch.Tensor, list[torch.Tensor]]:
    """A chunk whose saved tanh output the test keeps a handle on (to write to it)."""
    kept: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> bool:
        kept.append(t)
        return True

    block = swap_wrapper(_seeded(_Square()), policy_fn=keep)
    params = list(block.parameters())
    x = torch.from_numpy(make_data()[0][:, 0, :].copy())
    record = _collect(session, _loss_of(block), x, params)
    hidden = next(t for t in kept if t.grad_fn is not None and "Tanh" in t.grad_fn.name())
    return record, hidden, params


@pytest.mark.parametrize("when", ["before the offload", "after the copy"])
def test_in_place_modification_after_capture_is_refused_by_version(
    session: PipelineSwapSession, when: str
) -> None:
    """A write to a captured tensor (its ``_version`` moves) before the offload is refused
    when the offload is launched; one after the copy when the device tensor would be
    dropped. The error names the tensor and the version change, and nothing is dropped:
    every entry still holds its device tensor."""
    record, hidden, params = _with_handle_on_saved(session)
    moving = _moving(session)
    assert any(e.device is hidden for e in moving)
    if when == "before the offload":
        with torch.no_grad():
            hidden.add_(1.0)
        with pytest.raises(SwapError, match=r"tensor '_Square(#\d+)?'.*version 0 -> 1.*offload"):
            session.prepare_offload(0, 0)
        assert {e.state for e in moving} == {SwapState.DEVICE}
    else:
        session.prepare_offload(0, 0).run()
        with torch.no_grad():
            hidden.mul_(2.0)
        with pytest.raises(
            SwapError, match=r"tensor '_Square(#\d+)?'.*version 0 -> 1.*device memory was released"
        ):
            session.finish_offload(0, 0)
        assert {e.state for e in moving} == {SwapState.D2H}
    assert all(e.device is not None for e in moving)
    TORCH.autograd.release(record, params)


def test_a_modified_saved_tensor_left_on_device_is_refused_at_backward() -> None:
    """Saved-tensor hooks switch off torch's own check ("modified by an inplace
    operation"), and every pipeline forward runs under them: the backend's hooks check
    the version of a tensor unpacked as itself and refuse the backward, naming it."""
    x = torch.randn(3, 5, requires_grad=True)
    with TORCH.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = torch.tanh(x)  # saves its output
    with torch.no_grad():
        y.mul_(2.0)
    with pytest.raises(SavedTensorModifiedError, match=r"shape \(3, 5\).*version 0 -> 1"):
        torch.autograd.grad(y.sum(), x)

    with TORCH.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = torch.tanh(x)
    (grad,) = torch.autograd.grad(y.sum(), x)  # unmodified: the check passes
    torch.testing.assert_close(grad, 1 - torch.tanh(x.detach()) ** 2)


def test_a_restored_copy_is_not_refused_after_the_original_changed() -> None:
    """An unpack that returns a copy taken when the tensor was saved (what a swap load
    restores) computes with the saved values: a later write to the original is harmless
    and not refused (as with torch's save_on_cpu)."""
    x = torch.randn(3, 5, requires_grad=True)
    with TORCH.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t):
        y = torch.tanh(x)
    saved = torch.tanh(x.detach())
    with torch.no_grad():
        y.mul_(2.0)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, 1 - saved**2)  # the modified y would give 1 - 4 saved**2


# -- lazily conjugated and negated views ------------------------------------------------------


class _ConjugatedProduct(nn.Module):
    """A complex product whose backward reads ``z`` itself, a lazily conjugated view of it
    (``conj()`` sets a bit instead of copying: same storage, offset, shape, strides and
    dtype as ``z``) and the imaginary part of that view (which sets the negative bit)."""

    def __init__(self, z_first: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM, dtype=torch.complex64) * 0.3)
        self.z_first = z_first  # z saved before its lazy views, or after them
        self.z_storage = 0  # where the last forward's z lives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.complex(x, x.flip(-1)) @ self.w
        self.z_storage = z.untyped_storage().data_ptr()
        square = (z * z).real if self.z_first else None
        lazy = z.conj()  # the product saves it, conjugate bit and all
        out: torch.Tensor = (lazy @ self.w).real + lazy.imag * x
        return out + (square if square is not None else (z * z).real)


@pytest.mark.parametrize("z_first", [True, False], ids=["plain-view-first", "lazy-views-first"])
def test_lazily_conjugated_and_negated_saved_views_stay_on_device(
    session: PipelineSwapSession, z_first: bool
) -> None:
    """A view with torch's conjugate or negative bit is not its bytes: restored from them
    it would lose the bit (and its key is the plain view's, so one handle would serve
    both). It stays on device with every view of its storage; the rest of the chunk moves,
    and the gradients are bit-identical."""
    saved: list[tuple[bool, bool]] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.is_conj(), t.is_neg()))
        return t

    product = _ConjugatedProduct(z_first)
    block = swap_wrapper(_seeded(product))
    params = list(block.parameters())
    x = _input()
    with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
        expected = _backward(_record(_loss_of(block), x), params)
    assert (True, False) in saved and (False, True) in saved, saved  # the case is real

    record = _collect(session, _loss_of(block), x, params)
    group = session.manager.get_group(session.group_name(0, 0))
    devices = [e.device for e in group.entries()]
    assert not any(t.is_conj() or t.is_neg() for t in devices)
    # z itself stays on device with them: pinned, or never an entry (the chunk's ledger)
    assert product.z_storage and not any(
        e.key.storage_ptr == product.z_storage and not e.pinned for e in group.entries()
    )
    _round_trip(session)
    assert session.stats().offloaded_bytes > 0
    got = _backward(record, params)
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    session.release_chunk(0, 0)


# -- saved tensors without a storage ----------------------------------------------------------


class _SparseMask(nn.Module):
    """Saves a sparse tensor (``torch.sparse.mm`` keeps its sparse operand for the weight
    gradient), which has no storage the swap layer could name."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.fc(x))
        mask = (x.reshape(-1, DIM).abs() > 0.5).to(x.dtype).to_sparse()
        out: torch.Tensor = torch.sparse.mm(mask, self.fc.weight).reshape(x.shape) + hidden
        return out


def test_a_saved_sparse_tensor_is_left_to_the_graph(session: PipelineSwapSession) -> None:
    """A sparse saved tensor is neither counted nor moved (``Backend.storage_of`` names
    no storage for it); the dense ones of the same chunk move, and the gradients are
    bit-identical. Before, capturing it failed ('Cannot access storage of
    SparseTensorImpl'), with swap on or off."""
    block = swap_wrapper(_seeded(_SparseMask()))
    params = list(block.parameters())
    x = _input()
    expected = _backward(_record(_loss_of(block), x), params)

    record = _collect(session, _loss_of(block), x, params)
    moving = _moving(session)
    assert moving and all(e.device.layout is torch.strided for e in moving)
    _round_trip(session)
    assert session.stats().offloaded_bytes == sum(e.nbytes for e in moving)
    got = _backward(record, params)
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    session.release_chunk(0, 0)
