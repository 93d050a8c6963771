"""Measured peak saved bytes agree with the planner's memory model, exactly.

For a rank whose chunks are all alike, the model says: with swap, the peak holds
``peak_chunks_swap`` chunks' offloadable bytes plus, for every chunk alive at the peak, the
bytes alias protection keeps on device (stage inputs, targets, the loss root). Without swap
it holds ``peak_chunks_no_swap`` whole chunks. Both sides are measured from live storages;
the planner only contributes chunk counts.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from cyclic_garbage import collector_off, ppswap_cyclic_garbage, swap_tracked_per_storage
from mindspore import Tensor, nn

from ppswap import PipelineStage, run_schedule
from ppswap.backends.mindspore import BACKEND as MINDSPORE
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.simulate import memory_table
from ppswap.swap import swap_wrapper
from ppswap.swap.manager import current_collection

PP, MICRO, DIM = 4, 8, 32


def _stages() -> list[PipelineStage]:
    # Equal stages, every block wrapped: what swap may move is the same on
    # every rank; the loss's own saved tensors (last stage) stay on device.
    modules = build_mlp_stages(PP, dim=DIM, blocks_per_stage=6, wrap=swap_wrapper)
    return [PipelineStage(m, i, PP) for i, m in enumerate(modules)]


@pytest.mark.asyncio
async def test_gpipe_peak_matches_the_plan_and_halves() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * MICRO, DIM)).astype(np.float32)
    y = rng.standard_normal((2 * MICRO, DIM)).astype(np.float32)
    runs = {}
    for swap in (False, True):
        runs[swap] = await run_schedule(
            _stages(),
            "gpipe",
            micro_batch_num=MICRO,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            swap=swap,
        )
    assert runs[True].losses == runs[False].losses
    plan = memory_table(ScheduleConfig(schedule="gpipe", pp=PP, micro=MICRO, swap=True))
    for rank in range(PP):
        off, on, predicted = runs[False].ranks[rank], runs[True].ranks[rank], plan[rank]
        assert predicted["eligible"] == MICRO  # GPipe: every chunk's gap is >= 4
        chunk_bytes = off.peak_saved_bytes / predicted["peak_chunks_no_swap"]
        offloadable = on.offloaded_bytes / predicted["eligible"]
        pinned = chunk_bytes - offloadable
        assert offloadable > 0 and pinned >= 0
        expected = (
            predicted["peak_chunks_swap"] * offloadable + predicted["peak_chunks_no_swap"] * pinned
        )
        assert on.peak_saved_bytes == pytest.approx(expected, abs=1)
        assert on.peak_saved_bytes <= off.peak_saved_bytes / 2
        assert on.loaded_bytes == on.offloaded_bytes


class _CollectionProbe(nn.Cell):
    """Records, at each forward, whether a swap collection (and so its saved-tensor
    hooks) is active."""

    def __init__(self, seen: list[bool]) -> None:
        super().__init__()
        self.seen = seen

    def construct(self, x: Tensor) -> Tensor:
        self.seen.append(current_collection() is not None)
        return x


@pytest.mark.asyncio
async def test_a_run_without_counting_has_no_hooks_and_the_same_results() -> None:
    """``count_saved_bytes=False`` (without swap): no collection around any forward, so
    no saved-tensor hooks; losses and gradients bit-identical to the counting run, and
    ``peak_saved_bytes`` 0 where the counting run measured bytes."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * MICRO, DIM)).astype(np.float32)
    y = rng.standard_normal((2 * MICRO, DIM)).astype(np.float32)
    seen: dict[bool, list[bool]] = {True: [], False: []}
    runs, grads = {}, {}
    for count in (True, False):
        stages = _stages()
        first = stages[0]
        stages[0] = PipelineStage(
            nn.SequentialCell([_CollectionProbe(seen[count]), first.module]), 0, PP
        )
        runs[count] = await run_schedule(
            stages,
            "gpipe",
            micro_batch_num=MICRO,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            count_saved_bytes=count,
        )
        grads[count] = [g.asnumpy() for stage in stages for g in stage.grads]
    assert seen[True] == [True] * MICRO and seen[False] == [False] * MICRO
    assert runs[False].losses == runs[True].losses
    for a, b in zip(grads[True], grads[False], strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(rank.peak_saved_bytes > 0 for rank in runs[True].ranks)
    assert all(rank.peak_saved_bytes == 0 for rank in runs[False].ranks)


@pytest.mark.asyncio
async def test_swap_without_counting_counts_only_on_ranks_that_swap() -> None:
    """``swap=True, count_saved_bytes=False``: a rank whose plan swaps nothing (1F1B's
    last ranks) runs without hooks and reports 0; a rank that swaps still collects every
    chunk and reports what the counting run reports; losses, gradients and the bytes moved
    are those of the counting run, bit for bit."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * MICRO, DIM)).astype(np.float32)
    y = rng.standard_normal((2 * MICRO, DIM)).astype(np.float32)
    plan = memory_table(ScheduleConfig(schedule="1f1b", pp=PP, micro=MICRO, swap=True))
    swapping = {rank for rank in range(PP) if plan[rank]["eligible"] > 0}
    assert swapping and swapping != set(range(PP))  # both kinds of rank are in the run
    seen: dict[bool, list[list[bool]]] = {c: [[] for _ in range(PP)] for c in (True, False)}
    runs, grads = {}, {}
    for count in (True, False):
        stages = [
            PipelineStage(
                nn.SequentialCell([_CollectionProbe(seen[count][s.stage_index]), s.module]),
                s.stage_index,
                PP,
            )
            for s in _stages()
        ]
        runs[count] = await run_schedule(
            stages,
            "1f1b",
            micro_batch_num=MICRO,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            swap=True,
            count_saved_bytes=count,
        )
        grads[count] = [g.asnumpy() for stage in stages for g in stage.grads]
    assert runs[False].losses == runs[True].losses
    for a, b in zip(grads[True], grads[False], strict=True):
        np.testing.assert_array_equal(a, b)
    for rank in range(PP):
        counted, uncounted = runs[True].ranks[rank], runs[False].ranks[rank]
        assert seen[True][rank] == [True] * MICRO
        assert uncounted.offloaded_bytes == counted.offloaded_bytes
        if rank in swapping:
            assert seen[False][rank] == [True] * MICRO
            assert uncounted.offloaded_bytes > 0
            assert uncounted.peak_saved_bytes == counted.peak_saved_bytes > 0
        else:
            assert seen[False][rank] == [False] * MICRO
            assert uncounted.peak_saved_bytes == 0 < counted.peak_saved_bytes


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
async def test_a_finished_run_leaves_nothing_of_ppswap_to_the_garbage_collector(
    schedule: str,
) -> None:
    """With the collector off, stages built, run with and without swap, and dropped leave
    no ppswap object in a reference cycle: actors, swap groups, entries and chunk records
    are freed by reference counting when the run ends, the stages when the caller drops
    them (tests/torch_backend/test_torch_memory.py has the torch version)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * MICRO, DIM)).astype(np.float32)
    y = rng.standard_normal((2 * MICRO, DIM)).astype(np.float32)
    stage_num = PP if schedule == "gpipe" else 2 * PP
    with collector_off():
        modules = build_mlp_stages(stage_num, dim=DIM, blocks_per_stage=2, wrap=swap_wrapper)
        stages = [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]
        for swap in (False, True):
            result = await run_schedule(
                stages,
                schedule,
                micro_batch_num=MICRO,
                inputs=x,
                targets=y,
                loss_fn=mse_loss,
                swap=swap,
                pp=PP,
            )
            assert sum(rank.offloaded_bytes for rank in result.ranks) > 0 or not swap
        del modules, stages, result
        assert ppswap_cyclic_garbage() == Counter()


# Measured 17-19 on MindSpore 2.10 (one stage of six swap-wrapped blocks, 11 storages moved;
# the group's and the hooks' own objects are spread over them, and what MindSpore keeps
# without swap moves by about 25 objects from process to process). A layout with a record
# per field of a view (entry, storage record, fingerprint, block record, span and digest
# lists) measured 35-37.
TRACKED_PER_STORAGE = 24


def test_a_swapped_chunk_keeps_few_objects_for_the_collector_until_its_backward() -> None:
    """Every object a swapped chunk keeps from its forward to its backward outlives the
    young collections, so the full collections (which walk the whole process: 130-230 ms
    with MindSpore loaded) come sooner the more there are. Beyond what the same chunk
    keeps without swap, swap may keep at most ``TRACKED_PER_STORAGE`` tracked objects per
    storage it moves (the torch twin is in tests/torch_backend/test_torch_memory.py)."""
    x = Tensor(np.random.default_rng(0).standard_normal((4, DIM)).astype(np.float32))

    def build() -> nn.Cell:
        (module,) = build_mlp_stages(1, dim=DIM, blocks_per_stage=6, wrap=swap_wrapper)
        return module

    assert swap_tracked_per_storage(MINDSPORE, build, x) <= TRACKED_PER_STORAGE
