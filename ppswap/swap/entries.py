"""The entry table of a swap group: capture, deduplication, selection, pinning, seal.

:class:`EntryTable` is the collection half of a :class:`~ppswap.swap.group.SwapGroup`:
it turns saved tensors into :class:`SwapTensor` entries (one per exact view), records
which are *selected* for swap and which are *pinned* (never move), and at :meth:`seal`
settles what may move: the views of each movable storage become one
:class:`~ppswap.swap.spans.StorageSpan`, the unit the copies move (``spans.py``). The copy
lifecycle lives in ``group.py``.

Phases of a group; calls out of order raise :class:`SwapStateError`::

    COLLECTING --seal--> SEALED --prepare_offload--> OFFLOAD_PREPARED --finish_offload-->
    OFFLOADED --prepare_load--> LOAD_PREPARED --finish_load--> LOADED --release--> RELEASED
"""

from __future__ import annotations

import enum
import threading
import weakref

from ppswap.backends.base import Backend, CopyEngine, StorageRef, ViewKey
from ppswap.backends.types import Tensor
from ppswap.swap.accounting import SwapAccounting, storage_block
from ppswap.swap.errors import SwapStateError
from ppswap.swap.spans import StorageSpan
from ppswap.swap.tensor import (
    CHECK_MODES,
    CheckMode,
    EntryOwner,
    SwapState,
    SwapTensor,
)
from ppswap.swap.validation import check_bool, check_int

__all__ = ["EntryTable", "GroupPhase"]


class GroupPhase(enum.Enum):
    COLLECTING = "collecting"
    SEALED = "sealed"
    OFFLOAD_PREPARED = "offload_prepared"
    OFFLOADED = "offloaded"
    LOAD_PREPARED = "load_prepared"
    LOADED = "loaded"
    RELEASED = "released"


class EntryTable:
    """The entries of one chunk's group, keyed by exact view (see the module docstring).

    ``owner`` answers backward's unpack for the entries (the group itself, held weakly by
    the table and its entries: no reference cycle keeps a released group alive); ``backend``
    reads the tensors, ``engine`` says where their bytes are read from when they move,
    ``check`` how in-place modification is checked (``ppswap.swap.tensor``).
    """

    def __init__(
        self,
        name: str,
        stage: int,
        micro: int,
        *,
        backend: Backend,
        engine: CopyEngine,
        check: CheckMode,
        group_swap: bool,
        accounting: SwapAccounting | None,
        owner: EntryOwner,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if check not in CHECK_MODES:
            raise ValueError(f"check must be one of {', '.join(CHECK_MODES)}, got {check!r}")
        self.backend = backend
        self.engine = engine
        self.check: CheckMode = check
        self.name = name
        self.stage = check_int("stage", stage, 0)
        self.micro = check_int("micro", micro, 0)
        self.chunk = (self.stage, self.micro)
        self.group_swap = check_bool("group_swap", group_swap)
        self.accounting = accounting if accounting is not None else SwapAccounting()
        self._owner: weakref.ref[EntryOwner] = weakref.ref(owner)
        self._lock = threading.RLock()
        self._phase = GroupPhase.COLLECTING
        self._entries: list[SwapTensor] = []
        self._by_key: dict[ViewKey, SwapTensor] = {}
        self._by_storage: dict[int, list[SwapTensor]] = {}
        self._spans: dict[int, StorageSpan] = {}
        self._pinned_storages: set[int] = set()
        self._tags: set[str] = set()
        self._tag_next: dict[str, int] = {}

    @property
    def phase(self) -> GroupPhase:
        with self._lock:
            return self._phase

    def entries(self) -> tuple[SwapTensor, ...]:
        with self._lock:
            return tuple(self._entries)

    def spans(self) -> tuple[StorageSpan, ...]:
        """The storage spans that may move (made at :meth:`seal`), in capture order."""
        with self._lock:
            return tuple(self._spans.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def find(self, tensor: Tensor) -> SwapTensor | None:
        """The entry registered for exactly this view, if any."""
        key = self.backend.view_key(tensor, self.backend.storage_of(tensor))
        with self._lock:
            return self._by_key.get(key)

    # -- collection ---------------------------------------------------------------------

    def register(
        self,
        tensor: Tensor,
        *,
        tag: str | None = None,
        group_swap: bool | None = None,
        selected: bool = True,
        storage: StorageRef | None = None,
    ) -> SwapTensor:
        """Capture ``tensor`` (a saved tensor) and return its handle (deduplicated).

        ``selected=False`` records a saved tensor nobody asked to swap (yet): the graph
        still gets a handle, so a later ``select_storage`` (a ``swap_tensor_wrapper``
        call after the producer saved it) can still choose it; still unselected at
        :meth:`seal`, it is pinned. Registering an existing view again can only select it.
        ``storage`` is the tensor's :class:`StorageRef` when the caller already has it.
        """
        backend = self.backend
        info = storage if storage is not None else backend.storage_of(tensor)
        key = backend.view_key(tensor, info)
        with self._lock:
            if self._phase is not GroupPhase.COLLECTING:
                raise SwapStateError(
                    group=self.name,
                    tag=tag or "<new tensor>",
                    from_state=self._phase.value,
                    to_state=GroupPhase.COLLECTING.value,
                    detail="a group only captures during its chunk's forward",
                )
            bulk = self.group_swap if group_swap is None else group_swap
            existing = self._by_key.get(key)
            if existing is not None:
                if selected and not existing.selected:
                    existing.selected = True
                    existing.bulk = bulk
                return existing
            ptr, nbytes = info
            entries = self._entries
            block = storage_block(ptr)  # held while the entry is on device
            entry = SwapTensor(
                self._owner,
                self.name,
                self._unique_tag(tag or f"t{len(entries)}"),
                key,
                bulk,
                self.chunk,
                tensor,
                (ptr, nbytes, backend.version_of(tensor)),
                block,
                selected,
                ptr in self._pinned_storages,
            )
            self.accounting.hold(block, nbytes, entry, self.chunk)
            entries.append(entry)
            self._by_key[key] = entry
            held = self._by_storage.get(ptr)
            if held is None:
                self._by_storage[ptr] = [entry]
            else:
                held.append(entry)
            return entry

    def select_storage(self, storage_ptr: int, *, group_swap: bool) -> int:
        """Select every entry already captured on that storage; return how many."""
        with self._lock:
            chosen = 0
            for entry in self._by_storage.get(storage_ptr, ()):
                if not entry.selected:
                    entry.selected, entry.bulk = True, group_swap
                    chosen += 1
            return chosen

    def _unique_tag(self, tag: str) -> str:
        """``tag``, or ``tag#n`` with the smallest free ``n``: tags are never removed, so
        the search for a tag starts after the number it last took."""
        tags = self._tags
        if tag not in tags:
            tags.add(tag)
            return tag
        n = self._tag_next.get(tag, 1)
        unique = f"{tag}#{n}"
        while unique in tags:
            n += 1
            unique = f"{tag}#{n}"
        self._tag_next[tag] = n + 1
        tags.add(unique)
        return unique

    def pin_storage(self, storage_ptr: int) -> int:
        """Pin every still-resident entry on that storage (now and later); return count."""
        with self._lock:
            self._pinned_storages.add(storage_ptr)
            pinned = 0
            for entry in self._by_storage.get(storage_ptr, ()):
                if not entry.pinned and entry.state is SwapState.DEVICE:
                    entry.pinned = True
                    pinned += 1
            span = self._spans.get(storage_ptr)
            if span is not None and span.state is SwapState.DEVICE:
                del self._spans[storage_ptr]  # a pinned storage is never copied
                span.source = None
                for entry in span.entries:
                    entry.span = None
            return pinned

    def seal(self) -> None:
        """End of the chunk's forward: no more captures; settle what may move.

        Unselected entries, and those the engine cannot move (a CPU tensor a CUDA stage
        saved), are pinned; then every entry on a storage that has a pinned
        entry is pinned too (a storage only leaves the device when the group owns every
        saved view of it, otherwise the copy would free nothing). The views of each
        movable storage become one :class:`StorageSpan` with its copy source (the
        storage's bytes the views use, the engine's ``span_sources``, taken for all spans
        at once; a storage the framework cannot view that way is pinned) and, where the
        framework's version counter does not work, each view's content digest (the
        reference for every later check): O(1) per view unless ``check="full"``.
        """
        with self._lock:
            self._expect(GroupPhase.COLLECTING, GroupPhase.SEALED)
            can_move, span_of = self.engine.can_move, StorageSpan.of
            spans = []
            for ptr, entries in self._by_storage.items():
                for entry in entries:
                    device = entry.device
                    if not entry.selected or entry.pinned or device is None or not can_move(device):
                        for same_storage in entries:  # it stays: so do all its views
                            same_storage.pinned = True
                        break
                else:
                    spans.append(span_of(ptr, entries))
            self._attach_sources(spans)
            for span in spans:
                if span.source is None:
                    for entry in span.entries:
                        entry.pinned = True
                        entry.span = None
                else:
                    self._spans[span.storage_ptr] = span
            self._phase = GroupPhase.SEALED

    def _attach_sources(self, spans: list[StorageSpan]) -> None:
        """Give each span its copy source (through its first view the engine can read the
        span's bytes through; none: it stays on device) and, where the version counter
        does not work, its views' reference digests."""
        engine = self.engine
        requests = [(s.entries[0].device, s.start, s.nbytes) for s in spans]
        for span, source in zip(spans, engine.span_sources(requests), strict=True):
            for entry in span.entries[1:]:
                if source is not None:
                    break
                (source,) = engine.span_sources([(entry.device, span.start, span.nbytes)])
            span.source = source
            if source is None:
                continue
            fingerprint = span.entries[0].fingerprint
            if fingerprint is None or fingerprint[2] is None:  # no version counter
                host = engine.host_view(source)
                if host is not None:
                    span.take_digests(host, self.check)

    def _expect(self, phase: GroupPhase, target: GroupPhase) -> None:
        if self._phase is not phase:
            raise SwapStateError(
                group=self.name,
                tag="<group>",
                from_state=self._phase.value,
                to_state=target.value,
                detail=f"expected phase {phase.value}",
            )
