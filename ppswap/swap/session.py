"""PipelineSwapSession: the swap side of one pipeline run on one rank.

One session per run per rank (``generation`` numbers the runs). It owns the chunk
groups of the run (named ``pp_swap_run{generation}_s{stage}_m{micro}``), the chunk
ledgers and the memory accounting; the runtime owns the :class:`SwapManager` (with its
backend) and the :class:`CopyEngine` and passes them in.

Calls per chunk ``(stage, micro)``, all on the compute thread except ``CopyJob.run``::

    with session.collection_context(s, m, protected=inputs, parameters=params):
        out = the stage's forward, recorded         # FWD
    session.protect_aliases(s, m, [out, loss])      # pin what leaves the chunk
    job = session.prepare_offload(s, m)             # SWAP_LAUNCH_OFFLOAD
    job.run()                                       #   ... on the copy thread
    session.finish_offload(s, m)                    # SWAP_WAIT_OFFLOAD
    job = session.prepare_load(s, m)                # SWAP_LAUNCH_LOAD
    job.run()                                       #   ... on the copy thread
    session.finish_load(s, m)                       # SWAP_WAIT_LOAD
    grads = the recorded backward                   # BWD / BWD_INPUT
    session.release_chunk(s, m)

A chunk in ``recomputed`` (``ppswap.swap.recompute``) also has, between its FWD and its
BWD / BWD_INPUT, ``session.recompute_chunk(s, m, parameters)`` (RECOMPUTE): its FWD ran
with its :class:`ChunkRecompute` active, so its ``recompute_wrapper`` blocks kept their
calls and no saved tensor; the RECOMPUTE runs them again. Their inputs and regenerated
tensors are counted in the chunk's ledger until ``release_chunk``.

For a chunk not in ``eligible`` only the first and the last call apply: no group is
created and nothing is copied; the ledger still counts its saved tensors, unless the
session was made with ``count_saved=False`` (a run without swap that does not measure its
saved bytes: no hooks, ``peak_saved_bytes`` stays 0).

What a chunk's saved tensors become: parameters (and other module state passed as
``parameters``) are left alone and not counted. In a chunk with a group, every other
saved tensor that is not protected becomes an entry of the group (the graph keeps a
handle); it moves only if it was *selected* (saved inside ``swap_wrapper`` and accepted by
its policy, or registered with ``swap_tensor_wrapper`` before or after the save), all
others are pinned when the forward ends. The chunk's *ledger* records (by storage, with a
reference, until ``release_chunk``) what stays outside the group: every saved tensor of a
chunk without a group, protected storages (inputs, received buffers), and storages that
another live chunk already holds on device (say, a rotary table every micro-batch
saves). A captured entry on a storage that must stay resident is pinned: device memory is
only let go when the group owns every saved view of it.

Stats (:class:`SwapStats`, thread-safe): ``resident_saved_bytes`` is the device bytes of
the distinct storages (and loaded buffers) held by live chunks: ledger tensors, entries in
DEVICE/D2H/H2D, pinned entries; ``peak_saved_bytes`` its maximum.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection as CollectionABC
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import structlog

from ppswap.backends.base import CopyEngine, StorageRef
from ppswap.backends.types import Module, Tensor
from ppswap.core.deadlines import DEFAULT_STEP_TIMEOUT_S
from ppswap.swap.accounting import Chunk, SwapAccounting, storage_block
from ppswap.swap.errors import SwapError, SwapTimeoutError
from ppswap.swap.group import MAX_BUCKET_BYTES, SwapGroup
from ppswap.swap.jobs import CopyJob
from ppswap.swap.manager import SWAP_MIN_BYTES, Collection, SwapManager, tensors_in
from ppswap.swap.recompute import ChunkRecompute, recomputing
from ppswap.swap.tensor import CHECK_MODES, CheckMode, SwapState
from ppswap.swap.validation import check_bool, check_int, check_positive_seconds
from ppswap.swap.wrappers import capture_scope

__all__ = ["PipelineSwapSession", "SwapStats"]


@dataclass(frozen=True)
class SwapStats:
    """A consistent snapshot of one session's swap state (see the module docstring)."""

    resident_saved_bytes: int
    peak_saved_bytes: int
    offloaded_bytes: int
    loaded_bytes: int
    live_groups: int
    live_chunks: int
    jobs_in_flight: int
    unpack_waited_loads: int
    unpack_sync_loads: int
    unpack_device_fallbacks: int


@dataclass(eq=False)
class _ChunkRecord:
    """The ledger of one live chunk; implements :class:`SavedTensorSink`."""

    session: PipelineSwapSession
    chunk: Chunk
    group: SwapGroup | None
    recompute: ChunkRecompute | None = None
    resident: dict[int, Tensor] = field(default_factory=dict)

    @property
    def holder(self) -> tuple[str, int, int]:
        return ("ledger", *self.chunk)

    def must_stay_resident(self, storage: StorageRef) -> bool:
        if storage.ptr in self.resident:
            return True
        return self.session.accounting.held_by_other_chunk(storage_block(storage.ptr), self.chunk)

    def record_resident(self, tensor: Tensor, storage: StorageRef) -> None:
        if storage.ptr in self.resident:  # already recorded: already pinned everywhere
            return
        block = storage_block(storage.ptr)
        # Only a storage someone already holds can have a captured entry to pin (an entry
        # holds its storage's block while on device; a later capture of this storage, in
        # any chunk, sees this hold and stays resident itself).
        shared = self.session.accounting.is_held(block)
        self.resident[storage.ptr] = tensor
        self.session.accounting.hold(block, storage.nbytes, self.holder, self.chunk)
        if shared:
            self.session._pin_storage_everywhere(storage.ptr)

    def release(self) -> None:
        if self.recompute is not None:
            self.recompute.release()
        holder = self.holder
        self.session.accounting.drop_all([(storage_block(ptr), holder) for ptr in self.resident])
        self.resident.clear()


def _eligible_set(eligible: object) -> frozenset[Chunk]:
    if not isinstance(eligible, CollectionABC) or isinstance(eligible, str | bytes):
        raise TypeError(f"eligible must be a collection of (stage, micro) pairs, got {eligible!r}")
    chunks = set()
    for item in eligible:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"eligible items must be (stage, micro) tuples, got {item!r}")
        chunks.add(
            (check_int("eligible stage", item[0], 0), check_int("eligible micro", item[1], 0))
        )
    return frozenset(chunks)


class PipelineSwapSession:
    """Swap orchestration of one run on one rank (see the module docstring)."""

    def __init__(
        self,
        manager: SwapManager,
        engine: CopyEngine,
        *,
        rank: int,
        generation: int,
        eligible: CollectionABC[tuple[int, int]],
        wait_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        bucket_bytes: int = MAX_BUCKET_BYTES,
        check: CheckMode = "sampled",
        count_saved: bool = True,
        min_bytes: int = SWAP_MIN_BYTES,
        recomputed: CollectionABC[tuple[int, int]] = frozenset(),
    ) -> None:
        if not isinstance(manager, SwapManager):
            raise TypeError(f"manager must be a SwapManager, got {type(manager).__name__}")
        if not isinstance(engine, CopyEngine):
            raise TypeError(f"engine must implement CopyEngine, got {type(engine).__name__}")
        if check not in CHECK_MODES:
            raise ValueError(f"check must be one of {', '.join(CHECK_MODES)}, got {check!r}")
        self.manager = manager
        self.backend = manager.backend
        self.engine = engine.for_backend(manager.backend)
        self.check: CheckMode = check
        self.rank = check_int("rank", rank, 0)
        self.generation = check_int("generation", generation, 0)
        self.eligible = _eligible_set(eligible)
        self.recomputed = _eligible_set(recomputed)
        self.count_saved = check_bool("count_saved", count_saved)
        if not count_saved and self.eligible:
            raise ValueError(
                "count_saved must be True for a session with eligible chunks, got False "
                "(swap counts every saved tensor it captures)"
            )
        self.wait_timeout_s = check_positive_seconds("wait_timeout_s", wait_timeout_s)
        self.min_bytes = check_int("min_bytes", min_bytes, 0)
        self.bucket_bytes = bucket_bytes
        self.accounting = SwapAccounting()
        self.baseline_groups = len(manager)
        self._chunks: dict[Chunk, _ChunkRecord] = {}
        self._module_states: dict[Module, list[Tensor]] = {}  # of swap_wrapper-ed modules
        self._lock = threading.RLock()
        self._closed = False
        self._log = structlog.get_logger("ppswap").bind(
            actor="swap", rank=rank, generation=generation
        )

    def group_name(self, stage: int, micro: int) -> str:
        return f"pp_swap_run{self.generation}_s{stage}_m{micro}"

    def is_eligible(self, stage: int, micro: int) -> bool:
        return (stage, micro) in self.eligible

    # -- collection ---------------------------------------------------------------------

    @contextmanager
    def collection_context(
        self,
        stage: int,
        micro: int,
        protected: Iterable[Tensor] = (),
        parameters: Iterable[Tensor] = (),
    ) -> Iterator[None]:
        """Enter around a chunk's FWD (the forward under ``ms.vjp``); see the module doc.

        With ``count_saved=False`` (a session without eligible chunks) it only records
        the chunk as live: no collection, so no saved-tensor hooks and nothing counted.
        ``protected``: tensors whose storages are counted but never offloaded (stage
        inputs, received buffers). ``parameters``: the stage's parameters and any other
        module state (``module_state_tensors(module)`` gives parameters, buffers and
        plain Tensor attributes such as a rotary table), never offloaded, not counted.
        A chunk already collected and not released raises :class:`SwapError`.
        """
        chunk = (check_int("stage", stage, 0), check_int("micro", micro, 0))
        with self._lock:
            self._check_open()
            if chunk in self._chunks:
                raise SwapError(
                    f"chunk {chunk} of generation {self.generation} was already collected and "
                    "not released"
                )
            group = None
            if chunk in self.eligible:
                group = self.manager.create_group(
                    self.group_name(stage, micro),
                    stage,
                    micro,
                    engine=self.engine,
                    check=self.check,
                    bucket_bytes=self.bucket_bytes,
                    wait_timeout_s=self.wait_timeout_s,
                    accounting=self.accounting,
                )
            recompute = ChunkRecompute(chunk) if chunk in self.recomputed else None
            record = _ChunkRecord(session=self, chunk=chunk, group=group, recompute=recompute)
            self._chunks[chunk] = record
        if not self.count_saved:  # nothing to capture or count: no hooks at all
            with recomputing(recompute):
                yield
            return
        collection = Collection(
            self.backend,
            group=group,
            sink=record,
            protected=protected,
            parameters=parameters,
            module_states=self._module_states,
            min_bytes=self.min_bytes,
        )
        try:
            with capture_scope(collection), recomputing(recompute):
                yield
        except BaseException:
            collection.abandon()
            raise
        finally:
            collection.close()
        if group is not None:
            group.seal()

    def protect_aliases(self, stage: int, micro: int, tensors: Iterable[Tensor]) -> None:
        """Pin every entry of the chunk whose storage is shared with ``tensors``."""
        record = self._record(stage, micro, "protect_aliases")
        if record.group is None:
            return
        for tensor in tensors_in(self.backend, list(tensors)):
            record.group.pin_storage(self.backend.storage_of(tensor).ptr)

    def _pin_storage_everywhere(self, storage_ptr: int) -> None:
        if not self.eligible:  # no chunk has a group (a run without swap)
            return
        with self._lock:
            groups = [r.group for r in self._chunks.values() if r.group is not None]
        for group in groups:
            group.pin_storage(storage_ptr)

    def recompute_chunk(self, stage: int, micro: int, parameters: Iterable[Tensor]) -> int:
        """RECOMPUTE: run the chunk's ``recompute_wrapper`` blocks again, regenerating their
        saved tensors (counted in its ledger; ``parameters``: the stage's module state, not
        counted). Returns how many tensors were regenerated."""
        record = self._record(stage, micro, "recompute_chunk")
        if record.recompute is None:
            raise SwapError(
                f"recompute_chunk: chunk (stage={stage}, micro={micro}) is not recomputed "
                "(the plan did not select it)"
            )
        storage_of = self.backend.storage_of
        params = frozenset(storage_of(tensor).ptr for tensor in parameters)
        sink = record if self.count_saved else None
        return record.recompute.rerun(self.backend, sink, params)

    # -- the four swap steps --------------------------------------------------------------

    def prepare_offload(self, stage: int, micro: int) -> CopyJob:
        """SWAP_LAUNCH_OFFLOAD: DEVICE -> D2H; the returned job runs on the copy thread."""
        return self._group(stage, micro, "prepare_offload").prepare_offload()

    def finish_offload(self, stage: int, micro: int) -> int:
        """SWAP_WAIT_OFFLOAD: D2H -> HOST, device references dropped; bytes released."""
        return self._group(stage, micro, "finish_offload").finish_offload()

    def prepare_load(self, stage: int, micro: int) -> CopyJob:
        """SWAP_LAUNCH_LOAD: HOST -> H2D; the returned job runs on the copy thread."""
        return self._group(stage, micro, "prepare_load").prepare_load()

    def finish_load(self, stage: int, micro: int) -> int:
        """SWAP_WAIT_LOAD: H2D -> DEVICE (the engine's ``restore_views``); bytes restored."""
        return self._group(stage, micro, "finish_load").finish_load()

    def release_chunk(self, stage: int, micro: int) -> None:
        """After the chunk's BWD / BWD_INPUT: drop its ledger and remove its group."""
        record = self._record(stage, micro, "release_chunk")
        if record.group is not None:
            record.group.release()
            self.manager.remove_group(record.group.name)
        record.release()
        with self._lock:
            del self._chunks[record.chunk]

    def _record(self, stage: int, micro: int, op: str) -> _ChunkRecord:
        with self._lock:
            self._check_open()
            record = self._chunks.get((stage, micro))
        if record is None:
            raise SwapError(
                f"{op}: chunk (stage={stage}, micro={micro}) of generation {self.generation} "
                "is not live (never collected, or already released)"
            )
        return record

    def _group(self, stage: int, micro: int, op: str) -> SwapGroup:
        record = self._record(stage, micro, op)
        if record.group is None:
            raise SwapError(
                f"{op}: chunk (stage={stage}, micro={micro}) is not eligible for swap "
                "(the plan did not select it), so it has no group"
            )
        return record.group

    def _check_open(self) -> None:
        if self._closed:
            raise SwapError(f"swap session of generation {self.generation} is closed")

    # -- stats and teardown -------------------------------------------------------------

    def stats(self) -> SwapStats:
        with self._lock:
            groups = [r.group for r in self._chunks.values() if r.group is not None]
            live_chunks = len(self._chunks)
        in_flight = sum(1 for g in groups for j in g.jobs() if not j.done.is_set())
        unpack = self.accounting.unpack_counters()
        return SwapStats(
            resident_saved_bytes=self.accounting.resident_bytes,
            peak_saved_bytes=self.accounting.peak_bytes,
            offloaded_bytes=self.accounting.offloaded_bytes,
            loaded_bytes=self.accounting.loaded_bytes,
            live_groups=len(groups),
            live_chunks=live_chunks,
            jobs_in_flight=in_flight,
            unpack_waited_loads=unpack.waited_loads,
            unpack_sync_loads=unpack.sync_loads,
            unpack_device_fallbacks=unpack.device_fallbacks,
        )

    def _drop_all(self) -> list[_ChunkRecord]:
        with self._lock:
            records = list(self._chunks.values())
            self._chunks.clear()
            self._module_states.clear()
            self._closed = True
        for record in records:
            if record.group is not None:
                record.group.discard()
                if record.group.name in self.manager:
                    self.manager.remove_group(record.group.name)
            record.release()
        return records

    def close(self) -> None:
        """Normal end of the run: every group gone, ledger empty, counts at baseline.

        Chunks never released are dropped with a warning log. If a group still had
        entries in flight (an offload or load prepared and not finished), everything is
        dropped all the same and :class:`SwapError` is raised: that is a runtime bug.
        """
        if self._closed:
            return
        in_flight = []
        with self._lock:
            for record in self._chunks.values():
                if record.group is None:
                    continue
                for entry in record.group.entries():
                    if entry.state in (SwapState.D2H, SwapState.H2D):
                        in_flight.append(f"{record.group.name}/{entry.tag}:{entry.state.name}")
        leftovers = self._drop_all()
        if leftovers:
            self._log.warning("swap_close_unreleased_chunks", chunks=[r.chunk for r in leftovers])
        if in_flight:
            raise SwapError(
                f"swap session of generation {self.generation} closed with entries in flight: "
                f"{', '.join(in_flight[:8])}{' ...' if len(in_flight) > 8 else ''}"
            )

    def abort(self) -> None:
        """Best-effort teardown after an error or cancellation (compute thread).

        Waits (at most ``wait_timeout_s`` in total) for copy jobs running on the copy
        thread, cancels queued ones, then drops every reference and returns host buffers
        to the pool. Never raises, except :class:`SwapTimeoutError` when a running copy
        outlived the wait: then everything is dropped anyway (the running job hands its
        own buffers back when it ends), the timeout is logged, and the error raised.
        """
        if self._closed:
            return
        with self._lock:
            groups = [r.group for r in self._chunks.values() if r.group is not None]
        running = [job for group in groups for job in group.running_jobs()]
        deadline = time.monotonic() + self.wait_timeout_s
        stuck = [j for j in running if not j.done.wait(max(0.0, deadline - time.monotonic()))]
        self._drop_all()
        if stuck:
            self._log.error("swap_abort_copy_timeout", jobs=[repr(j) for j in stuck])
            raise SwapTimeoutError(
                f"abort: {len(stuck)} copy job(s) still running after {self.wait_timeout_s} s: "
                f"{stuck[0]!r}"
            )
