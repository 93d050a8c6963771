"""The pack function of a collection: what each saved tensor of a chunk's forward becomes.

A chunk's forward runs every tensor autograd saves through one pack function
(:func:`make_pack`), whose region arguments (capture, policy, group_swap, label) come
first: a capture region's hook is that function with its arguments bound. It returns
the tensor itself (a parameter, an empty tensor, not a tensor), a :class:`ResidentTensor`
handle (a saved tensor that stays on device, reported to the chunk's ledger) or the
group's :class:`~ppswap.swap.tensor.SwapTensor` entry.

The same tensor object saved again in the same forward (``y = tanh(x)`` saves ``y``, the
next layer saves its input ``y``) gets the handle it got the first time, without another
look at its storage: the collection keeps each object it packed, by identity, until the
forward ends (the handle holds it anyway, so its id cannot be reused meanwhile). A
handle is reused only where a new look could not change it: a ``ResidentTensor`` (what
makes a storage stay resident holds for the rest of the forward) or an entry already
selected for swap (selection never goes back); an unselected entry takes the full path,
which may select it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ppswap.backends.base import Backend, StorageRef
from ppswap.backends.types import Tensor
from ppswap.swap.group import SwapGroup
from ppswap.swap.tensor import SwapTensor

__all__ = [
    "OUTSIDE",
    "PackTarget",
    "PolicyFn",
    "Region",
    "Registration",
    "ResidentTensor",
    "SavedTensorSink",
    "make_pack",
    "policy_allows",
]

PolicyFn = Callable[[Tensor], bool]

Region = tuple[bool, PolicyFn | None, bool | None, str | None]
"""A capture region's pack arguments: capture, policy_fn, group_swap, label."""
OUTSIDE: Region = (False, None, None, "registered")
"""Outside any region: nothing is captured unless registered."""


class ResidentTensor:
    """A saved tensor that stays on device, packed as a handle instead of as itself.

    MindSpore keeps what the pack hook returned for a forward that raised part-way, and no
    backward will ever unpack it. As a handle, the collection can empty it when that
    forward fails (``Collection.abandon``), so only this small object stays behind.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor: Tensor | None = tensor


class SavedTensorSink(Protocol):
    """Where a collection reports saved tensors it does not capture (the chunk ledger)."""

    def must_stay_resident(self, storage: StorageRef) -> bool:
        """True if this storage is already held on device outside the chunk's group."""
        ...

    def record_resident(self, tensor: Tensor, storage: StorageRef) -> None:
        """A saved tensor stays on device (counted, never moved)."""
        ...


Registration = tuple[Tensor, str | None, bool]
"""A ``swap_tensor_wrapper`` registration: the tensor, its tag, its group_swap."""


class PackTarget(Protocol):
    """What the pack function reads of its collection at each call: the group (None for
    a chunk the plan does not swap) and the ledger; both None once the forward ended."""

    group: SwapGroup | None
    sink: SavedTensorSink | None


def policy_allows(policy_fn: PolicyFn | None, tensor: Tensor) -> bool:
    """``policy_fn``'s verdict on ``tensor`` (None allows all); a non-bool raises."""
    if policy_fn is None:
        return True
    verdict = policy_fn(tensor)
    if not isinstance(verdict, bool):
        raise TypeError(
            f"policy_fn must return a bool for each saved tensor, got {verdict!r} "
            f"for a tensor of shape {tuple(getattr(tensor, 'shape', ()))}"
        )
    return verdict


def make_pack(
    target: PackTarget,
    backend: Backend,
    *,
    parameters: dict[int, list[Tensor]],
    parameter_ids: set[int],
    protected: dict[int, Tensor],
    registered: dict[int, Registration],
    resident: list[ResidentTensor],
    packed: dict[int, tuple[Tensor, ResidentTensor | SwapTensor]],
    min_bytes: int,
) -> Callable[..., Any]:
    """The pack function of ``target`` (module docstring), its lookups bound once.

    ``parameters`` / ``protected`` / ``registered``: by storage address, what is never
    captured nor counted, counted but never captured, and registered for swap;
    ``parameter_ids``: the ids of the parameter objects themselves (held in
    ``parameters``), returned as they are without a look at their storage;
    ``resident``: every ResidentTensor handed out (emptied if the forward fails);
    ``packed``: each tensor object packed so far, with its handle, by ``id``.
    """
    is_tensor, storage_of, is_lazy_view = (
        backend.is_tensor,
        backend.storage_of,
        backend.is_lazy_view,
    )

    def pack(
        capture: bool,
        policy_fn: PolicyFn | None,
        group_swap: bool | None,
        label: str | None,
        tensor: Any,
    ) -> Any:
        seen = packed.get(id(tensor))
        if seen is not None:
            handle = seen[1]
            if handle.__class__ is ResidentTensor or handle.selected:  # type: ignore[union-attr]
                return handle
        elif id(tensor) in parameter_ids or not is_tensor(tensor):
            return tensor
        info = storage_of(tensor)
        ptr, nbytes = info
        if ptr in parameters or nbytes == 0:
            return tensor
        group, sink = target.group, target.sink
        if (
            group is None
            or nbytes < min_bytes
            or ptr in protected
            or is_lazy_view(tensor)
            or (sink is not None and sink.must_stay_resident(info))
        ):
            if sink is not None:
                sink.record_resident(tensor, info)
            kept = ResidentTensor(tensor)
            resident.append(kept)
            packed[id(tensor)] = (tensor, kept)
            return kept
        registration = registered.get(ptr)
        if registration is not None:
            entry = group.register(
                tensor,
                tag=registration[1] or label,
                group_swap=registration[2],
                storage=info,
            )
        else:
            selected = capture and (policy_fn is None or policy_allows(policy_fn, tensor))
            entry = group.register(
                tensor, tag=label, group_swap=group_swap, selected=selected, storage=info
            )
        packed[id(tensor)] = (tensor, entry)
        return entry

    return pack
