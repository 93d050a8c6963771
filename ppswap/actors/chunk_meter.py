"""ChunkMeter: the bytes each chunk of a rank keeps, measured as the run goes.

A memory budget is planned in bytes (``ppswap.scheduler.budget``), from what earlier steps
of the same stages measured per chunk (``RankStats.chunk_bytes``, read back by
``CostModel.from_result``). The meter stands between the step bodies and the swap session
(it is the ``SwapDriver`` the compute actor drives) and, on the compute thread, reads the
session's accounting of the chunk at three points:

- after the chunk's FWD: ``held``, the bytes the chunk keeps on device (every saved
  tensor of a kept or swapped chunk; the non-recomputed tensors and the recomputed blocks'
  inputs of a recomputed one);
- at SWAP_WAIT_OFFLOAD: ``moved``, the bytes the offload released;
- around RECOMPUTE: ``regenerated``, the bytes it added to the chunk.

It reads the chunk's own blocks (``SwapAccounting.chunk_bytes``), not the rank's total,
so a backward running beside the FWD in an overlapped composite does not blur it. Nothing
is measured where the session counts nothing (``count_saved=False``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from ppswap.backends.types import Tensor
from ppswap.results import ChunkBytes
from ppswap.swap import PipelineSwapSession
from ppswap.swap.jobs import CopyJob

__all__ = ["ChunkMeter"]

Chunk = tuple[int, int]


class ChunkMeter:
    """A ``SwapDriver`` that delegates to ``session`` and measures each chunk's bytes."""

    def __init__(self, session: PipelineSwapSession) -> None:
        self.session = session
        self._bytes: dict[Chunk, ChunkBytes] = {}

    @property
    def chunk_bytes(self) -> dict[Chunk, ChunkBytes]:
        """What was measured, by chunk ``(stage, micro)`` (a copy)."""
        return dict(self._bytes)

    def _held(self, chunk: Chunk) -> int:
        return self.session.accounting.chunk_bytes(chunk)

    @contextmanager
    def collection_context(
        self,
        stage: int,
        micro: int,
        protected: Sequence[Tensor] = (),
        parameters: Sequence[Tensor] = (),
    ) -> Iterator[Any]:
        with self.session.collection_context(stage, micro, protected, parameters) as value:
            yield value
        if self.session.count_saved:
            self._bytes[(stage, micro)] = ChunkBytes(held=self._held((stage, micro)))

    def protect_aliases(self, stage: int, micro: int, tensors: Iterable[Tensor]) -> None:
        self.session.protect_aliases(stage, micro, tensors)

    def prepare_offload(self, stage: int, micro: int) -> CopyJob:
        return self.session.prepare_offload(stage, micro)

    def finish_offload(self, stage: int, micro: int) -> int:
        released = self.session.finish_offload(stage, micro)
        measured = self._bytes.get((stage, micro))
        if measured is not None:
            self._bytes[(stage, micro)] = replace(measured, moved=released)
        return released

    def prepare_load(self, stage: int, micro: int) -> CopyJob:
        return self.session.prepare_load(stage, micro)

    def finish_load(self, stage: int, micro: int) -> int:
        return self.session.finish_load(stage, micro)

    def release_chunk(self, stage: int, micro: int) -> None:
        self.session.release_chunk(stage, micro)

    def recompute_chunk(self, stage: int, micro: int, parameters: Iterable[Tensor]) -> int:
        chunk = (stage, micro)
        before = self._held(chunk)
        regenerated = self.session.recompute_chunk(stage, micro, parameters)
        measured = self._bytes.get(chunk)
        if measured is not None and self.session.count_saved:
            self._bytes[chunk] = replace(measured, regenerated=self._held(chunk) - before)
        return regenerated
