"""swap_wrapper and swap_tensor_wrapper: choosing which activations are swapped (RFC 5.1).

Both only *select*; when bytes move is decided by the pipeline schedule (the session).

``swap_wrapper(module_or_callable, policy_fn=None, group_swap=False)``
    Wraps an ``nn.Cell`` in a :class:`SwapWrapperCell` (so ``layers[i] =
    swap_wrapper(layers[i])`` works and ``trainable_params()`` still finds the same
    Parameter objects, in the same order; their *names* gain the ``module.`` path
    segment, as with any wrapper cell) or a plain callable in a function. When its forward
    runs inside a collection context that has a group, it installs
    ``mindspore.saved_tensors_hooks`` whose pack captures every tensor the forward saves
    for backward into the group, unless ``policy_fn(tensor)`` returns False or the
    storage is protected (parameters, module tensors such as a rotary table attribute,
    stage inputs, pinned storages); those stay on device (packed as ``ResidentTensor``
    handles) and are still counted in the chunk's ledger. Without a group it runs the
    wrapped object plainly (the session's outer hook still counts what it saves).

``swap_tensor_wrapper(target, tag=None, group_swap=False)``
    Registers a tensor (or the tensors of a nested tuple/list/dict) by storage with the
    current collection: when autograd saves any view of that storage during the chunk's
    forward, it is captured. Returns ``target`` itself. With no collection context at all
    it warns (:class:`SwapWarning`) and does nothing; inside the context of a chunk the
    plan did not select (no group) it does nothing, silently: that is the schedule's
    decision, not a user error.

Argument errors (raised at wrap/call time): a non-callable ``module_or_callable``, a
non-callable non-None ``policy_fn``, a non-bool ``group_swap``, a ``tag`` that is not a
str or None, a ``target`` that is not a Tensor/tuple/list/dict: ``TypeError`` naming the
parameter. A ``policy_fn`` that raises propagates; one that returns a non-bool raises
``TypeError``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import mindspore as ms
from mindspore import Parameter, Tensor, nn

from ppswap.swap.errors import SwapError, SwapWarning
from ppswap.swap.manager import (
    Collection,
    PolicyFn,
    ResidentTensor,
    activate,
    current_collection,
    tensors_in,
)
from ppswap.swap.tensor import SwapTensor
from ppswap.swap.validation import check_bool

__all__ = [
    "SwapWrapperCell",
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
    registered with ``swap_tensor_wrapper``; ``swap_wrapper`` regions replace it with
    their own hooks (MindSpore applies only the innermost hooks), which do both too.
    """

    def pack(tensor: Any) -> Any:
        return collection.pack_saved(tensor, capture=False, label="registered")

    with activate(collection), ms.saved_tensors_hooks(pack, unpack_saved):
        yield collection


def module_state_tensors(cell: nn.Cell) -> list[Tensor]:
    """Every tensor a cell tree owns: parameters, buffers and plain Tensor attributes."""
    found: list[Tensor] = list(cell.get_parameters())
    for _, sub in cell.cells_and_names():
        buffers = getattr(sub, "_buffers", None)
        if isinstance(buffers, dict):
            found.extend(v for v in buffers.values() if isinstance(v, Tensor))
        found.extend(
            v for v in vars(sub).values() if isinstance(v, Tensor) and not isinstance(v, Parameter)
        )
    return found


def _run_captured(
    call: Callable[[], T],
    *,
    policy_fn: PolicyFn | None,
    group_swap: bool,
    label: str,
    owner: nn.Cell | None,
) -> T:
    collection = current_collection()
    if collection is None or collection.group is None:
        return call()

    def pack(tensor: Any) -> Any:
        return collection.pack_saved(
            tensor, capture=True, policy_fn=policy_fn, group_swap=group_swap, label=label
        )

    state = module_state_tensors(owner) if owner is not None else []
    with collection.module_state(state), ms.saved_tensors_hooks(pack, unpack_saved):
        return call()


class SwapWrapperCell(nn.Cell):  # type: ignore[misc]
    """A cell whose forward saves activations into the current swap group."""

    def __init__(self, module: nn.Cell, policy_fn: PolicyFn | None, group_swap: bool) -> None:
        super().__init__(auto_prefix=False)
        self.module = module
        self.policy_fn = policy_fn
        self.group_swap = group_swap
        self._swap_label = type(module).__name__

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        return _run_captured(
            lambda: self.module(*args, **kwargs),
            policy_fn=self.policy_fn,
            group_swap=self.group_swap,
            label=self._swap_label,
            owner=self.module,
        )


def _check_policy(policy_fn: object) -> PolicyFn | None:
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(
            f"swap_wrapper(policy_fn=...): expected a callable taking a Tensor and returning "
            f"a bool, or None; got {type(policy_fn).__name__} {policy_fn!r}"
        )
    return policy_fn  # type: ignore[return-value]


def swap_wrapper(
    module_or_callable: Any, policy_fn: PolicyFn | None = None, group_swap: bool = False
) -> Any:
    """Wrap a Cell or callable so its saved activations join the current swap group."""
    policy = _check_policy(policy_fn)
    check_bool("swap_wrapper(group_swap=...)", group_swap)
    if isinstance(module_or_callable, nn.Cell):
        return SwapWrapperCell(module_or_callable, policy, group_swap)
    if not callable(module_or_callable):
        raise TypeError(
            "swap_wrapper(module_or_callable=...): expected an nn.Cell or a callable, got "
            f"{type(module_or_callable).__name__} {module_or_callable!r}"
        )
    func: Callable[..., Any] = module_or_callable
    owner = getattr(func, "__self__", None)
    label = getattr(func, "__qualname__", type(func).__name__)

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return _run_captured(
            lambda: func(*args, **kwargs),
            policy_fn=policy,
            group_swap=group_swap,
            label=label,
            owner=owner if isinstance(owner, nn.Cell) else None,
        )

    return wrapped


def swap_tensor_wrapper(target: T, tag: str | None = None, group_swap: bool = False) -> T:
    """Register ``target``'s tensors for swap in the current chunk; return ``target``."""
    if tag is not None and not isinstance(tag, str):
        raise TypeError(
            f"swap_tensor_wrapper(tag=...): expected a str or None, got {type(tag).__name__}"
        )
    check_bool("swap_tensor_wrapper(group_swap=...)", group_swap)
    if not isinstance(target, Tensor | tuple | list | dict):
        raise TypeError(
            "swap_tensor_wrapper(target=...): expected a Tensor or a tuple/list/dict of "
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
    for tensor in tensors_in(target):
        collection.register(tensor, tag=tag, group_swap=group_swap)
    return target
