"""swap_wrapper and swap_tensor_wrapper: the user's choice of which activations may move.

Both only *select*; when bytes move is decided by the pipeline schedule (the session).
Both dispatch on the framework of what they are given (``ppswap.backends``): the same
two functions serve MindSpore cells and torch modules.

``swap_wrapper(module_or_callable, policy_fn=None, group_swap=False)``
    Wraps a module (``nn.Cell``, ``torch.nn.Module``) in its backend's wrapper module (so
    ``layers[i] = swap_wrapper(layers[i])`` works and the parameters are the same objects,
    in the same order; their *names* gain the ``module.`` path segment, as with any
    wrapper) or a plain callable in a function. When its forward runs inside a collection
    context that has a group, the collection's own saved-tensor hooks (or, where the
    collection installed none, hooks of the region's own) capture every tensor the
    forward saves into the group, unless ``policy_fn(tensor)`` returns False or
    the storage is protected (parameters, module tensors such as a rotary table
    attribute, stage inputs, pinned storages); those stay on device (packed as
    ``ResidentTensor`` handles) and are still counted in the chunk's ledger. Without a
    group it runs the wrapped object plainly (the session's outer hook still counts what
    it saves).

``swap_tensor_wrapper(target, tag=None, group_swap=False)``
    Registers a tensor (or the tensors of a nested tuple/list/dict) by storage with the
    current collection: when autograd saves any view of that storage during the chunk's
    forward, it is captured. Returns ``target`` itself. With no collection context at all
    it warns (:class:`SwapWarning`) and does nothing; inside the context of a chunk the
    plan did not select (no group) it does nothing, silently: that is the schedule's
    decision, not a user error.

Argument errors (raised at wrap/call time): a non-callable ``module_or_callable``, a
non-callable non-None ``policy_fn``, a non-bool ``group_swap``, a ``tag`` that is not a
str or None, a ``target`` that is not a tensor/tuple/list/dict: ``TypeError`` naming the
parameter. A ``policy_fn`` that raises propagates; one that returns a non-bool raises
``TypeError``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from ppswap.backends import backend_for, framework_of
from ppswap.backends.types import Module, Tensor
from ppswap.swap.errors import SwapError, SwapWarning
from ppswap.swap.manager import (
    Collection,
    PolicyFn,
    ResidentTensor,
    activate,
    current_collection,
)
from ppswap.swap.tensor import SwapTensor
from ppswap.swap.validation import check_bool

__all__ = [
    "SwapCapture",
    "capture_scope",
    "module_state_tensors",
    "swap_tensor_wrapper",
    "swap_wrapper",
    "unpack_saved",
]

T = TypeVar("T")


def unpack_saved(packed: Any) -> Any:
    """The unpack hook: a SwapTensor handle becomes its (loaded) tensor, a ResidentTensor
    handle its tensor."""
    if isinstance(packed, SwapTensor):
        return packed.materialize()
    if isinstance(packed, ResidentTensor):
        if packed.tensor is None:
            raise SwapError("a backward unpacked a saved tensor of a forward that had failed")
        return packed.tensor
    return packed


@contextmanager
def capture_scope(collection: Collection) -> Iterator[Collection]:
    """Activate ``collection`` and install the outer saved-tensor hooks around a forward.

    The outer pack counts every saved tensor in the ledger and captures the ones
    registered with ``swap_tensor_wrapper``; inside a ``swap_wrapper`` region it also
    captures as the region says (``Collection.region``: one pair of hooks per forward,
    none of the region's own).
    """

    hook = collection.hook()
    with activate(collection), collection.backend.saved_tensors_hooks(hook, unpack_saved):
        collection.hooks_active = True
        try:
            yield collection
        finally:
            collection.hooks_active = False


def module_state_tensors(module: Module) -> list[Tensor]:
    """Every tensor a module tree owns: parameters, buffers and plain tensor attributes."""
    return backend_for(module).module_state(module)


@dataclass(frozen=True, slots=True)
class SwapCapture:
    """What a ``swap_wrapper`` region does around its forward: capture saved tensors into
    the current group (``policy_fn`` choosing, ``group_swap`` packing), never touching
    ``owner``'s module state. Called with the forward as a zero-argument callable."""

    policy_fn: PolicyFn | None
    group_swap: bool
    label: str
    owner: Module | None

    def __call__(self, call: Callable[[], T]) -> T:
        collection = current_collection()
        if collection is None or collection.group is None:
            return call()
        if collection.backend.foreign_saved_tensors_hooks():
            # Hooks entered around this region (activation checkpointing's, which keeps
            # nothing and recomputes; save_on_cpu) take its saved tensors: swap's, being
            # innermost, would otherwise override them and keep what they drop.
            return call()

        state = collection.state_of(self.owner) if self.owner is not None else []
        if collection.hooks_active:  # its own hooks are the innermost: set their region
            region = collection.region(self.policy_fn, self.group_swap, self.label)
            with collection.module_state(state), region:
                return call()
        # A collection without hooks of its own (SwapManager.collecting): the region's.
        pack = collection.pack_hook(
            capture=True, policy_fn=self.policy_fn, group_swap=self.group_swap, label=self.label
        )
        backend = collection.backend
        with collection.module_state(state), backend.saved_tensors_hooks(pack, unpack_saved):
            return call()


def _check_policy(policy_fn: object) -> PolicyFn | None:
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(
            f"swap_wrapper(policy_fn=...): expected a callable taking a tensor and returning "
            f"a bool, or None; got {type(policy_fn).__name__} {policy_fn!r}"
        )
    return policy_fn


def swap_wrapper(
    module_or_callable: Any, policy_fn: PolicyFn | None = None, group_swap: bool = False
) -> Any:
    """Wrap a module or callable so its saved activations join the current swap group."""
    policy = _check_policy(policy_fn)
    check_bool("swap_wrapper(group_swap=...)", group_swap)
    if framework_of(module_or_callable) is not None:
        backend = backend_for(module_or_callable, "swap_wrapper(module_or_callable=...)")
        if backend.is_module(module_or_callable):
            label = type(module_or_callable).__name__
            capture = SwapCapture(policy, group_swap, label, module_or_callable)
            return backend.wrap_for_swap(module_or_callable, capture)
    if not callable(module_or_callable):
        raise TypeError(
            "swap_wrapper(module_or_callable=...): expected a module (mindspore.nn.Cell, "
            "torch.nn.Module) or a callable, got "
            f"{type(module_or_callable).__name__} {module_or_callable!r}"
        )
    func: Callable[..., Any] = module_or_callable
    owner = getattr(func, "__self__", None)
    owner_module = owner if framework_of(owner) is not None else None
    if owner_module is not None and not backend_for(owner_module).is_module(owner_module):
        owner_module = None
    capture = SwapCapture(
        policy, group_swap, getattr(func, "__qualname__", type(func).__name__), owner_module
    )

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return capture(lambda: func(*args, **kwargs))

    return wrapped


def swap_tensor_wrapper(target: T, tag: str | None = None, group_swap: bool = False) -> T:
    """Register ``target``'s tensors for swap in the current chunk; return ``target``."""
    if tag is not None and not isinstance(tag, str):
        raise TypeError(
            f"swap_tensor_wrapper(tag=...): expected a str or None, got {type(tag).__name__}"
        )
    check_bool("swap_tensor_wrapper(group_swap=...)", group_swap)
    if not isinstance(target, tuple | list | dict) and framework_of(target) is None:
        raise TypeError(
            "swap_tensor_wrapper(target=...): expected a tensor or a tuple/list/dict of "
            f"tensors, got {type(target).__name__}"
        )
    collection = current_collection()
    if collection is None:
        warnings.warn(
            f"swap_tensor_wrapper(tag={tag!r}) called outside any swap collection context "
            "(not inside a pipeline chunk's forward); the tensor is not swapped",
            SwapWarning,
            stacklevel=2,
        )
        return target
    if collection.group is None:
        return target
    for tensor in collection.tensors_in(target):
        collection.register(tensor, tag=tag, group_swap=group_swap)
    return target
