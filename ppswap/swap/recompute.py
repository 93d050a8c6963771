"""recompute_wrapper: blocks whose saved tensors a recomputed chunk regenerates, not keeps.

``recompute_wrapper(module)`` wraps a module (``nn.Cell``, ``torch.nn.Module``) in its
backend's wrapper module, like ``swap_wrapper`` (the parameters are the same objects, in
the same order; their names gain the ``module.`` segment). It only *selects*: whether a
chunk is recomputed is the plan's decision (``scheduler/recompute_plan.py``; the option
``recompute=True`` recomputes every chunk of a stage that has such a block).

In the FWD of a recomputed chunk (the session activates its :class:`ChunkRecompute`), a
wrapped block's forward runs under hooks that keep none of the tensors it saves: each is
packed as a :class:`RecomputedTensor` slot. The block's call (the module and its
arguments: the inputs, counted in the chunk's ledger as resident) and its forward context
(``Backend.forward_context``: the generator states it draws from, the autocast settings)
are kept instead. At the chunk's RECOMPUTE step, ``ChunkRecompute.rerun`` runs each kept
call again under its context (``Backend.rerun_forward``), filling the slots in the order
the graph saves them (a block that saves a different number of tensors the second time
is not deterministic and is refused); the backward unpacks the slots. Dropout masks are
the FWD's (the generators are restored), so losses and gradients are bit-identical to the
same run without recompute. The regenerated tensors are counted in the chunk's ledger
until the chunk is released (after BWD, or BWD_WEIGHT where the backend defers dw: they
serve both passes of the dx/dw split). Outside a recomputed chunk the wrapper runs the
block plainly (its saved tensors are the chunk's, kept or swapped).

A block wrapped by both ``recompute_wrapper`` and ``swap_wrapper``, in either order, is
recomputed in a recomputed chunk and swapped (where the plan swaps the chunk) in the
others: the recompute region hides the chunk's collection from the regions inside it, so
a ``swap_wrapper`` inside runs plainly under its hooks, and a ``swap_wrapper`` outside
has its hooks replaced by its (the innermost apply). With swap and recompute in one run,
the other blocks of a recomputed chunk are swapped as the swap policy says
(``"recompute+swap"``). A ``swap_tensor_wrapper`` call inside a recomputed block finds no
collection (its tensors are not kept anyway) and warns.

MindSpore: its ``nn.Dropout`` (``ops.Dropout``) draws from per-operator states that no
generator state restores, so a recomputed block with dropout must use the generator's
dropout (``mint.nn.Dropout``, ``mint.nn.functional.dropout``) to be bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ppswap.backends import backend_for, framework_of
from ppswap.backends.base import Backend
from ppswap.backends.types import Module, Tensor
from ppswap.swap.errors import SwapError
from ppswap.swap.manager import SavedTensorSink, activate, current_collection, tensors_in

__all__ = [
    "ChunkRecompute",
    "RecomputeRegion",
    "RecomputedTensor",
    "has_recompute_blocks",
    "recompute_wrapper",
    "recomputing",
]


class RecomputedTensor:
    """What the graph keeps for a saved tensor of a recomputed block: a slot its
    RECOMPUTE fills (``tensor``), empty until then and after the chunk's release."""

    __slots__ = ("tensor",)

    def __init__(self) -> None:
        self.tensor: Tensor | None = None


def unpack_recomputed(slot: RecomputedTensor) -> Tensor:
    """The unpack hook of a recomputed block: its slot's regenerated tensor."""
    tensor = slot.tensor
    if tensor is None:
        raise SwapError(
            "a backward unpacked a saved tensor of a recompute_wrapper block before the "
            "chunk's RECOMPUTE step ran (or after the chunk was released)"
        )
    return tensor


@dataclass(eq=False)
class _KeptCall:
    """One run of a recomputed block in the FWD: the call, its context, its slots."""

    call: Callable[[], Any]
    context: object
    slots: list[RecomputedTensor] = field(default_factory=list)

    def pack(self, _tensor: Any) -> RecomputedTensor:
        slot = RecomputedTensor()
        self.slots.append(slot)
        return slot


@dataclass(eq=False)
class ChunkRecompute:
    """The recompute side of one recomputed chunk ``(stage, micro)`` (module docstring):
    the block calls its FWD kept, until ``release``."""

    chunk: tuple[int, int]
    calls: list[_KeptCall] = field(default_factory=list)
    rerun_done: bool = False

    def rerun(
        self,
        backend: Backend,
        sink: SavedTensorSink | None,
        parameters: frozenset[int],
    ) -> int:
        """RECOMPUTE: run every kept call again, filling its slots; the regenerated
        tensors other than parameters (storages in ``parameters``) are reported to
        ``sink`` as resident. Returns how many tensors were regenerated."""
        if self.rerun_done:
            raise SwapError(f"chunk {self.chunk} was already recomputed")
        self.rerun_done = True
        storage_of = backend.storage_of
        regenerated = 0
        for kept in self.calls:
            slots = kept.slots
            position = 0

            def fill(tensor: Tensor, slots: list[RecomputedTensor] = slots) -> None:
                nonlocal position
                if position >= len(slots):
                    raise SwapError(
                        f"chunk {self.chunk}: a recompute_wrapper block saved more tensors "
                        f"when recomputed than in its forward ({len(slots)}): it is not "
                        "deterministic and cannot be recomputed"
                    )
                slots[position].tensor = tensor
                position += 1
                info = storage_of(tensor)
                if sink is not None and info.nbytes and info.ptr not in parameters:
                    sink.record_resident(tensor, info)

            with activate(None), recomputing(None):
                backend.rerun_forward(kept.call, kept.context, fill)
            if position != len(slots):
                raise SwapError(
                    f"chunk {self.chunk}: a recompute_wrapper block saved {position} tensors "
                    f"when recomputed, {len(slots)} in its forward: it is not deterministic "
                    "and cannot be recomputed"
                )
            regenerated += position
        return regenerated

    def release(self) -> None:
        """Drop the kept calls (their inputs) and empty every slot."""
        for kept in self.calls:
            for slot in kept.slots:
                slot.tensor = None
        self.calls.clear()


_CURRENT: ContextVar[ChunkRecompute | None] = ContextVar("ppswap_recompute", default=None)


@contextmanager
def recomputing(chunk: ChunkRecompute | None) -> Iterator[None]:
    """Make ``chunk`` the recomputed chunk whose FWD runs in the block (None: none)."""
    token = _CURRENT.set(chunk)
    try:
        yield
    finally:
        _CURRENT.reset(token)


@dataclass(frozen=True, slots=True)
class _BlockCall:
    """A block's forward as a zero-argument call (what a recomputed chunk keeps)."""

    module: Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self) -> Any:
        return self.module(*self.args, **self.kwargs)


@dataclass(frozen=True, slots=True)
class RecomputeRegion:
    """What a ``recompute_wrapper`` module does around its block's forward: in a
    recomputed chunk's FWD, keep the call and drop what it saves; else run it. Called by
    the backend's wrapper module with the block and its arguments."""

    label: str

    def __call__(self, module: Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = _BlockCall(module, args, kwargs)
        chunk = _CURRENT.get()
        if chunk is None:
            return call()
        backend = backend_for(module)
        collection = current_collection()
        if collection is not None and collection.sink is not None:
            # A recomputed chunk keeps the block's arguments: counted in its ledger, and
            # a swap group then keeps their storages on device.
            storage_of, sink = backend.storage_of, collection.sink
            for tensor in tensors_in(backend, (args, kwargs)):
                info = storage_of(tensor)
                if info.nbytes and not collection.is_parameter(info.ptr):
                    sink.record_resident(tensor, info)
        kept = _KeptCall(call, backend.forward_context())
        chunk.calls.append(kept)
        with (
            activate(None),
            recomputing(None),
            backend.saved_tensors_hooks(kept.pack, unpack_recomputed),
        ):
            return call()


def recompute_wrapper(module: Any) -> Any:
    """Wrap a module so a recomputed chunk regenerates, not keeps, what it saves."""
    if framework_of(module) is None:
        raise TypeError(
            "recompute_wrapper(module=...): expected a module (mindspore.nn.Cell, "
            f"torch.nn.Module), got {type(module).__name__} {module!r}"
        )
    backend = backend_for(module, "recompute_wrapper(module=...)")
    if not backend.is_module(module):
        raise TypeError(
            "recompute_wrapper(module=...): expected a module (mindspore.nn.Cell, "
            f"torch.nn.Module), got {type(module).__name__}"
        )
    return backend.wrap_for_recompute(module, RecomputeRegion(type(module).__name__))


def has_recompute_blocks(backend: Backend, module: Module) -> bool:
    """Whether ``module`` holds a ``recompute_wrapper`` block (or is one)."""
    return any(
        isinstance(getattr(sub, "recompute_region", None), RecomputeRegion)
        for _, sub in backend.submodules(module)
    )
