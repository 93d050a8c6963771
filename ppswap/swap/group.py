"""SwapGroup: the captured saved tensors of one chunk and their bulk moves.

A group holds the :class:`SwapTensor` entries of one chunk ``(stage, micro)``, deduplicated
by exact view identity (the collection half, :class:`EntryTable`, is in ``entries.py``,
with the phases; ``release`` is legal from any phase when no copy job is in flight,
``discard`` always).

Copies move storage spans (``spans.py``): the bytes of one storage that its captured views
use, once however many views overlap them. A span with ``bulk=False`` gets its own pooled
host buffer; ``bulk=True`` spans (``group_swap=True``) are packed, in capture order, into
contiguous host buckets of at most ``bucket_bytes`` (32 MiB), one memcpy per span into its
64-byte aligned slice; a span larger than a bucket gets a bucket of its own. A bucket is
loaded with one memcpy into fresh device memory and every span is a slice of it. The views
of a loaded span are rebuilt as views of it (``CopyEngine.restore_views``), so they share
one allocation as before the offload.

Pinned entries never move. Everything the copy thread needs is handed to it inside the
job; the copy thread touches the group only at the very end of a job, under the group
lock, to hand its buffers back if the group was discarded meanwhile.

Threading: every method except the copy-job bodies runs on the compute thread. All of
them take the group lock; :meth:`materialize` never holds it while waiting.
"""

from __future__ import annotations

from typing import Any

from ppswap.backends.base import Backend, CopyEngine
from ppswap.backends.host_memory import HOST_ALIGNMENT
from ppswap.backends.types import Tensor
from ppswap.swap.accounting import DeviceBlock, SwapAccounting
from ppswap.swap.entries import EntryTable, GroupPhase
from ppswap.swap.errors import SwapError, SwapStateError
from ppswap.swap.jobs import CopyJob, JobKind
from ppswap.swap.spans import StorageSpan
from ppswap.swap.tensor import CheckMode, SwapState, SwapTensor
from ppswap.swap.transfer import HostBucket, Load, Offload
from ppswap.swap.validation import check_int, check_positive_seconds

__all__ = ["MAX_BUCKET_BYTES", "GroupPhase", "SwapGroup"]

MAX_BUCKET_BYTES = 32 * 1024 * 1024


class SwapGroup(EntryTable):
    """The swap entries of one chunk and their copies (see the module docstring)."""

    def __init__(
        self,
        name: str,
        stage: int,
        micro: int,
        *,
        backend: Backend,
        engine: CopyEngine,
        check: CheckMode = "sampled",
        group_swap: bool = False,
        bucket_bytes: int = MAX_BUCKET_BYTES,
        wait_timeout_s: float = 60.0,
        accounting: SwapAccounting | None = None,
    ) -> None:
        super().__init__(
            name,
            stage,
            micro,
            backend=backend,
            engine=engine,
            check=check,
            group_swap=group_swap,
            accounting=accounting,
            owner=self,
        )
        if check_int("bucket_bytes", bucket_bytes, HOST_ALIGNMENT) > MAX_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes must be <= {MAX_BUCKET_BYTES}, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.wait_timeout_s = check_positive_seconds("wait_timeout_s", wait_timeout_s)
        self._offload_job: CopyJob | None = None
        self._offload: Offload | None = None  # from prepare_offload to finish_offload
        self._offload_copied = False
        self._host_buckets: list[HostBucket] = []
        self._load_job: CopyJob | None = None
        self._load: Load | None = None  # from prepare_load to finish_load

    def jobs(self) -> tuple[CopyJob, ...]:
        with self._lock:
            return tuple(j for j in (self._offload_job, self._load_job) if j is not None)

    def running_jobs(self) -> tuple[CopyJob, ...]:
        """Jobs started on the copy thread and not finished (in flight)."""
        return tuple(j for j in self.jobs() if j.started and not j.done.is_set())

    # -- offload ------------------------------------------------------------------------

    def prepare_offload(self) -> CopyJob:
        """DEVICE -> D2H for every unpinned entry; return the job the copy thread runs
        (one copy per storage span).

        Every entry's storage identity and version are checked first (O(1) each); if one
        changed, nothing moves and :class:`SwapError` is raised. The content checks run on
        the copy thread (``Offload.run``).
        """
        with self._lock:
            self._expect(GroupPhase.SEALED, GroupPhase.OFFLOAD_PREPARED)
            movable = [span for span in self._spans.values() if span.movable()]
            for span in movable:
                for entry in span.entries:
                    entry.check_unchanged(self.backend, "before its offload")
            offload = Offload.build(movable, self.bucket_bytes)
            engine, check = self.engine, self.check

            def work() -> None:
                try:
                    offload.run(engine, check)
                finally:
                    with self._lock:
                        if self._phase is GroupPhase.RELEASED:
                            offload.release(engine)
                        else:
                            self._offload_copied = True

            job = (
                CopyJob(kind=JobKind.OFFLOAD, group=self.name, nbytes=offload.nbytes, work=work)
                if movable
                else CopyJob.empty(JobKind.OFFLOAD, self.name)
            )
            for span in movable:
                span.transition(SwapState.D2H)
                for entry in span.entries:
                    entry.job = job
            self._offload = offload
            self._offload_job = job
            self._phase = GroupPhase.OFFLOAD_PREPARED
            return job

    def finish_offload(self) -> int:
        """D2H -> HOST; drop the device references; return the device bytes released.

        Before a device tensor is dropped its storage, version and content digest are
        checked once more (O(1) each): a write after the copy would make the host copy
        stale, so it raises :class:`SwapError` and nothing is dropped.
        """
        with self._lock:
            self._expect(GroupPhase.OFFLOAD_PREPARED, GroupPhase.OFFLOADED)
            job = self._finished_job(self._offload_job, SwapState.D2H, SwapState.HOST)
            offload = self._offload
            assert offload is not None
            backend, engine, check = self.backend, self.engine, self.check
            for span in offload.spans:
                for entry in span.entries:
                    entry.check_unchanged(backend, "before its device memory was released")
                if span.digests is not None:
                    span.verify(engine.host_view(span.source), check, "after its copy")
            before = self.accounting.resident_bytes
            dropped: list[tuple[DeviceBlock, SwapTensor]] = []
            for span, host in zip(offload.spans, offload.hosts, strict=True):
                span.transition(SwapState.HOST)
                span.host = host
                span.source = None
                for entry in span.entries:
                    entry.job = None
                    _forget_device(entry, dropped)
            self.accounting.drop_all(dropped)
            for bucket in offload.buckets:
                bucket.holding = len(bucket.members)
                for span, _ in bucket.members:
                    span.host_bucket = bucket
            self._host_buckets = offload.buckets
            self._offload = None
            self._offload_copied = False
            self.accounting.add_offloaded(job.nbytes)
            self._phase = GroupPhase.OFFLOADED
            return before - self.accounting.resident_bytes

    # -- load ---------------------------------------------------------------------------

    def prepare_load(self) -> CopyJob:
        """HOST -> H2D for every offloaded entry; return the job the copy thread runs
        (one copy per storage span, or per bucket).

        The destination memory is counted as resident from here (the copy allocates it):
        one block per span (or bucket), held by every view in it. Spans the backward
        already loaded through the safety net are skipped.
        """
        with self._lock:
            self._expect(GroupPhase.OFFLOADED, GroupPhase.LOAD_PREPARED)
            load = Load.build(
                [
                    span
                    for span in self._spans.values()
                    if span.state is SwapState.HOST and span.host_bucket is None
                ],
                self._host_buckets,
                self.bucket_bytes,
            )
            taken = {id(bucket) for bucket, _ in load.buckets}
            self._host_buckets = [b for b in self._host_buckets if id(b) not in taken]
            engine, check = self.engine, self.check

            def work() -> None:
                try:
                    load.run(engine, check)
                finally:
                    self._release_load(engine, load)

            spans = load.spans
            job = (
                CopyJob(
                    kind=JobKind.LOAD,
                    group=self.name,
                    nbytes=load.nbytes,
                    work=work,
                    on_cancel=lambda: self._release_load(engine, load),
                )
                if spans
                else CopyJob.empty(JobKind.LOAD, self.name)
            )
            # The memory the copy allocates counts as resident from here: a block per
            # span with a host buffer of its own, one per bucket (sized as the bucket).
            new_block = self.accounting.new_loaded_block
            held: list[tuple[DeviceBlock, int, list[SwapTensor]]] = []
            for span in load.single:
                held.append((new_block(), span.nbytes, span.entries))
            for bucket, moving in load.buckets:
                holders = [entry for span, _ in moving for entry in span.entries]
                held.append((new_block(), bucket.nbytes, holders))
            self.accounting.hold_blocks(held, self.chunk)
            for block, _, holders in held:
                for entry in holders:
                    entry.device_block = block
                    entry.job = job
            for span in spans:
                span.transition(SwapState.H2D)
                span.host, span.host_bucket = None, None
            self._load = load
            self._load_job = job
            self._phase = GroupPhase.LOAD_PREPARED
            return job

    def _release_load(self, engine: CopyEngine, load: Load) -> None:
        with self._lock:
            load.release(engine)

    def finish_load(self) -> int:
        """H2D -> DEVICE (the engine's ``restore_views``); return the span bytes restored
        by this call."""
        with self._lock:
            self._expect(GroupPhase.LOAD_PREPARED, GroupPhase.LOADED)
            self._finished_job(self._load_job, SwapState.H2D, SwapState.DEVICE)
            load = self._load
            assert load is not None
            restored = 0
            for span, loaded in zip(load.spans, load.loaded, strict=True):
                if span.state is SwapState.H2D:
                    self._complete_load(span, loaded)
                    restored += span.nbytes
            load.loaded = []
            self._load = None
            self._phase = GroupPhase.LOADED
            self.accounting.add_loaded(restored)
            return restored

    def _finished_job(
        self, job: CopyJob | None, from_state: SwapState, to_state: SwapState
    ) -> CopyJob:
        assert job is not None
        if not job.finished:
            raise SwapStateError(
                group=self.name,
                tag=f"<{job.kind.value} job>",
                from_state=from_state,
                to_state=to_state,
                detail=f"the {job.kind.value} copy has not run (job phase {job.phase.value})",
            )
        self._raise_if_failed(job)
        return job

    def _raise_if_failed(self, job: CopyJob) -> None:
        if job.error is not None:
            raise SwapError(
                f"{job.kind.value} of group {self.name!r} failed: {job.error}"
            ) from job.error

    def _complete_load(self, span: StorageSpan, loaded: Any) -> None:
        """The loaded span as one framework tensor, every view rebuilt into it."""
        if loaded is None:
            raise SwapError(
                f"group {self.name!r} tensor {span.entries[0].tag!r}: load produced no data"
            )
        views = self.engine.restore_views(loaded, span.places())
        span.transition(SwapState.DEVICE)
        for entry, view in zip(span.entries, views, strict=True):
            entry.device = view
            entry.job = None

    # -- backward's unpack (the safety net) ---------------------------------------------

    def materialize(self, entry: SwapTensor) -> Tensor:
        """The tensor backward needs, complete and verified (see SwapTensor.materialize).

        DEVICE: the live tensor. D2H: the still-alive device tensor. HOST (load never
        launched): a synchronous load of the entry's span. H2D: wait for the load job
        (bounded), then finish the load of the entry's span. Either way the other views
        of the storage come back with it. A released group raises :class:`SwapStateError`.
        """
        with self._lock:
            state = entry.state
            if entry.released:
                raise self._released(entry, "backward unpacked a tensor of a released group")
            if state is SwapState.DEVICE or state is SwapState.D2H:
                assert entry.device is not None
                if state is SwapState.D2H:
                    self.accounting.count_device_fallback()
                return entry.device
            span = entry.span
            assert span is not None
            if state is SwapState.HOST:
                self._load_now(span)
                assert entry.device is not None
                return entry.device
            job = entry.job
        assert job is not None
        was_pending = not job.done.is_set()
        job.wait(self.wait_timeout_s)
        with self._lock:
            if entry.released:
                raise self._released(entry, "the group was released while backward waited")
            if entry.state is SwapState.DEVICE:
                assert entry.device is not None
                return entry.device
            self._raise_if_failed(job)
            load = self._load
            assert load is not None
            index = load.spans.index(span)
            self._complete_load(span, load.loaded[index])
            self.accounting.add_loaded(span.nbytes)
            load.loaded[index] = None
            if was_pending:
                self.accounting.count_waited_load()
            assert entry.device is not None
            return entry.device

    def _released(self, entry: SwapTensor, detail: str) -> SwapStateError:
        return SwapStateError(
            group=self.name,
            tag=entry.tag,
            from_state="released",
            to_state=SwapState.DEVICE,
            detail=detail,
        )

    def _load_now(self, span: StorageSpan) -> None:
        """Backward's synchronous load of a span the load job never took."""
        host, bucket = span.host, span.host_bucket
        assert host is not None
        loaded = self.engine.load_now(host)
        span.verify(self.engine.host_view(loaded), self.check, "while it was on the host")
        span.transition(SwapState.H2D)
        block = self.accounting.new_loaded_block()
        for entry in span.entries:
            entry.device_block = block
        self.accounting.hold_all(block, span.nbytes, span.entries, self.chunk)
        span.host, span.host_bucket = None, None
        if bucket is None:
            self.engine.release_host(host)
        else:
            bucket.holding -= 1
            if bucket.holding == 0 and bucket.raw is not None:
                self.engine.release_host(bucket.raw)
                bucket.raw = None
                self._host_buckets = [b for b in self._host_buckets if b is not bucket]
        self.accounting.count_sync_load()
        self._complete_load(span, loaded)
        self.accounting.add_loaded(span.nbytes)

    # -- teardown -----------------------------------------------------------------------

    def release(self) -> None:
        """Normal end of the chunk: drop every reference and give host buffers back.

        Raises :class:`SwapStateError` (and releases nothing) if a copy job of this group
        is still running on the copy thread.
        """
        with self._lock:
            running = self.running_jobs()
            if running:
                raise SwapStateError(
                    group=self.name,
                    tag="<group>",
                    from_state=self._phase.value,
                    to_state=GroupPhase.RELEASED.value,
                    detail=f"copy job in flight: {running[0]!r}",
                )
            self._teardown()

    def discard(self) -> None:
        """Best-effort teardown (abort); never raises.

        Queued jobs are cancelled; a job still running hands its own buffers back to the
        pool when it ends (it sees the group released under the lock).
        """
        with self._lock:
            self._teardown()

    def _teardown(self) -> None:
        if self._phase is GroupPhase.RELEASED:
            return
        self._phase = GroupPhase.RELEASED
        for job in (self._offload_job, self._load_job):
            if job is not None:
                job.cancel()
        engine = self.engine
        if self._offload_copied and self._offload is not None:
            self._offload.release(engine)
        for span in self._spans.values():
            if span.host is not None and span.host_bucket is None:
                engine.release_host(span.host)
            span.source, span.host, span.host_bucket = None, None, None
        for bucket in self._host_buckets:
            if bucket.raw is not None:
                engine.release_host(bucket.raw)
                bucket.raw = None
        dropped: list[tuple[DeviceBlock, SwapTensor]] = []
        for entry in self._entries:
            _forget_device(entry, dropped)
            entry.span = None
            entry.job = None
            entry.released = True
        self.accounting.drop_all(dropped)
        self._by_key.clear()
        self._by_storage.clear()
        self._spans.clear()
        self._offload, self._load, self._host_buckets = None, None, []
        self._offload_job = self._load_job = None

    def __repr__(self) -> str:
        return (
            f"SwapGroup(name={self.name!r}, entries={len(self._entries)}, "
            f"phase={self._phase.value})"
        )


def _forget_device(entry: SwapTensor, dropped: list[tuple[DeviceBlock, SwapTensor]]) -> None:
    """Drop ``entry``'s device tensor; add the block it held to ``dropped`` (the caller
    gives all of them back to the accounting at once)."""
    if entry.device_block is not None:
        dropped.append((entry.device_block, entry))
    entry.device = None
    entry.device_block = None
