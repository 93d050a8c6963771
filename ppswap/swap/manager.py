"""SwapManager (groups by name) and the current collection context (a ContextVar).

The *collection context* is what a chunk's forward runs in: a :class:`Collection` says
which group (if any) captures saved tensors, which storages must never be offloaded, which
tensors ``swap_tensor_wrapper`` registered, and where ledger-only saved tensors are
reported. It lives in one module-level ``contextvars.ContextVar``; :func:`activate` sets it
for a ``with`` block and restores the previous value on exit, so nested contexts restore
the outer one, and every thread (fresh context) and every asyncio task (copied context)
sees only what was set in it. There is no global manager: the runtime owns one
:class:`SwapManager` per rank and passes it where it is needed.

Storage identity is the storage's base address (``untyped_storage().data_ptr()``). An
address is only meaningful while the storage is alive, so every structure keyed by
address here also holds a reference to a tensor of that storage for as long as the key is
kept (the collection drops them all at :meth:`Collection.close`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from functools import partial
from typing import Any

from ppswap.backends.base import Backend, CopyEngine
from ppswap.backends.types import Module, Tensor
from ppswap.swap.accounting import SwapAccounting
from ppswap.swap.errors import SwapError
from ppswap.swap.group import MAX_BUCKET_BYTES, SwapGroup
from ppswap.swap.packing import (
    OUTSIDE,
    PolicyFn,
    Region,
    Registration,
    ResidentTensor,
    SavedTensorSink,
    make_pack,
)
from ppswap.swap.tensor import CheckMode, SwapTensor
from ppswap.swap.validation import check_int

__all__ = [
    "SWAP_MIN_BYTES",
    "Collection",
    "PolicyFn",
    "ResidentTensor",
    "SavedTensorSink",
    "SwapManager",
    "activate",
    "current_collection",
    "tensors_in",
]

SWAP_MIN_BYTES = 0
"""The default ``min_bytes``: every saved tensor the user marked may move, whatever its
size. Raising it (4096 is a good value) keeps small storages on device: moving one costs
the compute thread on the order of a hundred microseconds of bookkeeping whatever its
size (docs/swap.md), and a storage under a page frees next to nothing."""


_CURRENT: ContextVar[Collection | None] = ContextVar("ppswap_swap_collection", default=None)


def current_collection() -> Collection | None:
    """The collection context active in this thread/task, or None."""
    return _CURRENT.get()


@contextmanager
def activate(collection: Collection | None) -> Iterator[Collection | None]:
    """Make ``collection`` current for the block (``None`` hides an outer one)."""
    token = _CURRENT.set(collection)
    try:
        yield collection
    finally:
        _CURRENT.reset(token)


def tensors_in(backend: Backend, obj: object) -> Iterator[Tensor]:
    """The tensors of ``obj``: a tensor, or tuples/lists/dict values nested; others
    skipped."""
    is_tensor = backend.is_tensor
    if is_tensor(obj):
        yield obj
        return
    if isinstance(obj, dict):
        items: Iterable[object] = obj.values()
    elif isinstance(obj, tuple | list):
        items = obj
    else:
        return
    for item in items:  # a tensor per item is the common case: no nested generator
        if is_tensor(item):
            yield item
        else:
            yield from tensors_in(backend, item)


def _sequence(tensors: Iterable[Tensor]) -> tuple[Tensor, ...] | list[Tensor]:
    """``tensors`` itself where it is a tuple or list (what a stage passes), else a list
    of it (an iterator is read once)."""
    return tensors if isinstance(tensors, tuple | list) else list(tensors)


_NO_STATE = nullcontext()
"""The block of a ``module_state`` that added nothing (a nullcontext can be re-entered)."""


class _RegionScope:
    """``with collection.region(...)``: sets the collection's current region, restores
    the previous one on exit (a class, not a generator: entered once per region call)."""

    __slots__ = ("_collection", "_previous", "_region")

    def __init__(self, collection: Collection, region: Region) -> None:
        self._collection = collection
        self._region = region
        self._previous: Region = OUTSIDE

    def __enter__(self) -> None:
        collection = self._collection
        self._previous = collection._region
        collection._region = self._region

    def __exit__(self, *exc: object) -> None:
        self._collection._region = self._previous


class Collection:
    """The collection context of one chunk's forward (see the module docstring).

    ``parameters``: storages that are neither captured nor counted (module state:
    parameters, buffers). ``protected``: storages that are counted but never captured
    (stage inputs, received buffers). Both match any view of the storage.
    ``module_states``: where the module state of ``swap_wrapper``-ed modules is kept once
    taken (a session keeps it for its run, as a stage keeps its own); None: taken at
    every call.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        group: SwapGroup | None,
        sink: SavedTensorSink | None = None,
        protected: Iterable[Tensor] = (),
        parameters: Iterable[Tensor] = (),
        module_states: dict[Module, list[Tensor]] | None = None,
        min_bytes: int = SWAP_MIN_BYTES,
    ) -> None:
        self.backend = backend
        self.min_bytes = check_int("min_bytes", min_bytes, 0)
        self.group = group
        self.sink = sink
        self._module_states = module_states
        self._parameters: dict[int, list[Tensor]] = {}
        self._protected: dict[int, Tensor] = {}
        self._registered: dict[int, Registration] = {}
        self._resident: list[ResidentTensor] = []  # handles packed during this forward
        # Each tensor object packed during this forward with its handle (packing.py)
        self._packed: dict[int, tuple[Tensor, ResidentTensor | SwapTensor]] = {}
        storage_of, by_storage = backend.storage_of, self._parameters
        # The same objects a swap_wrapper's module state lists again (the stage passes its
        # whole module state): ``module_state`` skips them without reading their storage.
        # Held in ``_parameters`` for the whole forward, so their ids cannot be reused.
        self._parameter_ids: set[int] = set()
        for tensor in tensors_in(backend, _sequence(parameters)):
            ptr = storage_of(tensor).ptr
            held = by_storage.get(ptr)
            if held is None:
                by_storage[ptr] = [tensor]
            else:
                held.append(tensor)
            self._parameter_ids.add(id(tensor))
        for tensor in tensors_in(backend, _sequence(protected)):
            self._protected[storage_of(tensor).ptr] = tensor
        # Held until close(), which drops it (the function refers to this collection):
        # None once the forward has ended.
        self._pack: Callable[..., Any] | None = self._make_pack()
        # The arguments of the capture region the forward is in now (``region``): what
        # the collection's own hook (``hook``) packs with. Outside any region: nothing is
        # captured unless registered.
        self._region: Region = OUTSIDE
        self.hooks_active = False

    def tensors_in(self, obj: object) -> Iterator[Tensor]:
        """The tensors of ``obj`` (see :func:`tensors_in`)."""
        return tensors_in(self.backend, obj)

    def is_parameter(self, storage_ptr: int) -> bool:
        return storage_ptr in self._parameters

    def is_protected(self, storage_ptr: int) -> bool:
        return storage_ptr in self._protected or storage_ptr in self._parameters

    def state_of(self, module: Module) -> list[Tensor]:
        """``module``'s parameters, buffers and plain tensor attributes (``module_states``
        says how long they are kept)."""
        if self._module_states is None:
            return self.backend.module_state(module)
        state = self._module_states.get(module)
        if state is None:
            state = self._module_states[module] = self.backend.module_state(module)
        return state

    def module_state(self, tensors: Iterable[Tensor]) -> AbstractContextManager[None]:
        """Treat ``tensors`` as parameters (never captured or counted) inside the block.

        The parameters are added now, when the context manager is made (a stage passes
        its whole module state to the collection, so usually none is new: then nothing
        is added and the block runs in a shared no-op context)."""
        added = []
        known = self._parameter_ids
        for tensor in tensors:
            if id(tensor) in known:
                continue
            ptr = self.backend.storage_of(tensor).ptr
            self._parameters.setdefault(ptr, []).append(tensor)
            added.append(ptr)
        return self._without(added) if added else _NO_STATE

    @contextmanager
    def _without(self, added: list[int]) -> Iterator[None]:
        """Remove the parameters ``module_state`` added (by storage) when the block ends."""
        try:
            yield
        finally:
            for ptr in added:
                held = self._parameters.get(ptr)
                if held:
                    held.pop()
                    if not held:
                        del self._parameters[ptr]

    def register(self, tensor: Tensor, *, tag: str | None, group_swap: bool) -> None:
        """Ask for ``tensor``'s storage to be swapped: every saved view of it, whether
        autograd saved it before this call (its producer saved its output) or saves it
        later in the chunk's forward. Parameters are ignored (never swapped).
        """
        if self._pack is None:
            raise SwapError("swap_tensor_wrapper called after its chunk's forward ended")
        if self.backend.is_parameter(tensor):
            return
        info = self.backend.storage_of(tensor)
        if info.nbytes == 0:
            return
        self._registered[info.ptr] = (tensor, tag, group_swap)
        if self.group is not None:
            self.group.select_storage(info.ptr, group_swap=group_swap)

    def pack_hook(
        self,
        *,
        capture: bool,
        policy_fn: PolicyFn | None = None,
        group_swap: bool | None = None,
        label: str | None = None,
    ) -> Callable[[Any], Any]:
        """The pack hook of one capture region: returns a SwapTensor handle, a
        ResidentTensor handle, or the tensor itself.

        Parameters (and empty tensors) are returned untouched and not counted. Without a
        group, or for a protected storage, one smaller than ``min_bytes``, one held on
        device elsewhere or a lazy view (``Backend.is_lazy_view``: its bytes are not its
        values), the tensor is reported to the sink (which keeps every view of that
        storage on device) and returned as a ResidentTensor (emptied by :meth:`abandon`
        if the forward fails). Otherwise it becomes an entry of the group, *selected* for
        swap when ``capture`` is set and ``policy_fn`` agrees, or when its storage was
        registered (before or, via :meth:`SwapGroup.select_storage`, after this save).

        Every region of the collection shares one pack function, its lookups bound once
        (it runs for every tensor a forward saves, and the autograd graph keeps each
        region's hook until the backward): a region's hook is that function with the
        region's arguments bound.
        """
        if self._pack is None:
            raise SwapError("a capture region entered after its chunk's forward ended")
        return partial(self._pack, capture, policy_fn, group_swap, label)

    def hook(self) -> Callable[[Any], Any]:
        """The collection's own pack hook (``capture_scope`` installs it around the
        forward): packs with the arguments of the capture region the forward is in
        (:meth:`region`), outside any region as ``pack_hook(capture=False,
        label="registered")`` does."""
        pack = self._pack
        if pack is None:
            raise SwapError("a capture region entered after its chunk's forward ended")

        def hook(tensor: Any) -> Any:
            return pack(*self._region, tensor)

        return hook

    def region(
        self, policy_fn: PolicyFn | None, group_swap: bool | None, label: str | None
    ) -> _RegionScope:
        """Inside the block, the collection's own hook (:meth:`hook`) captures as
        ``pack_hook(capture=True, ...)`` with these arguments does: a capture region
        without hooks of its own, for a region the collection's hooks already cover (they
        are the innermost ones). Nested regions restore the outer one."""
        if self._pack is None:
            raise SwapError("a capture region entered after its chunk's forward ended")
        return _RegionScope(self, (True, policy_fn, group_swap, label))

    def _make_pack(self) -> Callable[..., Any]:
        """The collection's pack function (:meth:`pack_hook`), region arguments first."""
        return make_pack(
            self,
            self.backend,
            parameters=self._parameters,
            parameter_ids=self._parameter_ids,
            protected=self._protected,
            registered=self._registered,
            resident=self._resident,
            packed=self._packed,
            min_bytes=self.min_bytes,
        )

    def abandon(self) -> None:
        """The forward raised: empty the handles it packed (no backward will unpack them)."""
        for handle in self._resident:
            handle.tensor = None

    def close(self) -> None:
        """End of the forward: forget registrations, protections, handles, the group and the
        sink (drop references: MindSpore may keep the pack hook, and with it this object)."""
        self._pack = None
        self._registered.clear()
        self._protected.clear()
        self._parameters.clear()
        self._parameter_ids.clear()
        self._resident.clear()
        self._packed.clear()
        self._region = OUTSIDE
        self.hooks_active = False
        self.group = None
        self.sink = None


class SwapManager:
    """The swap groups of one rank, by name. Thread-safe; never a singleton.

    ``backend`` reads the tensors its groups capture.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._groups: dict[str, SwapGroup] = {}

    def create_group(
        self,
        name: str,
        stage: int,
        micro: int,
        *,
        engine: CopyEngine,
        check: CheckMode = "sampled",
        group_swap: bool = False,
        bucket_bytes: int = MAX_BUCKET_BYTES,
        wait_timeout_s: float = 60.0,
        accounting: SwapAccounting | None = None,
    ) -> SwapGroup:
        """Create and register a group whose bytes ``engine`` moves; a name still in use
        raises :class:`SwapError`."""
        group = SwapGroup(
            name,
            stage,
            micro,
            backend=self.backend,
            engine=engine.for_backend(self.backend),
            check=check,
            group_swap=group_swap,
            bucket_bytes=bucket_bytes,
            wait_timeout_s=wait_timeout_s,
            accounting=accounting,
        )
        with self._lock:
            if name in self._groups:
                raise SwapError(
                    f"swap group {name!r} already exists (a stale group of an earlier run "
                    "or a chunk collected twice); remove it first"
                )
            self._groups[name] = group
        return group

    def get_group(self, name: str) -> SwapGroup:
        with self._lock:
            group = self._groups.get(name)
            if group is None:
                raise KeyError(f"no swap group named {name!r}; live: {sorted(self._groups)}")
            return group

    def remove_group(self, name: str) -> SwapGroup:
        """Unregister the group and return it (releasing it is the caller's job)."""
        with self._lock:
            group = self._groups.pop(name, None)
            if group is None:
                raise KeyError(f"no swap group named {name!r}; live: {sorted(self._groups)}")
            return group

    def group_names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._groups)

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._groups

    @contextmanager
    def collecting(self, name: str) -> Iterator[Collection]:
        """Make the named group the capture target of ``swap_wrapper`` in the block.

        For use outside a pipeline session (no ledger); the group is sealed on exit.
        """
        group = self.get_group(name)
        collection = Collection(self.backend, group=group)
        try:
            with activate(collection):
                yield collection
        finally:
            collection.close()
        group.seal()
