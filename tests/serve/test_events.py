"""ppswap.events: a run's progress as it happens, on both backends; bounded, drop-oldest,
never blocking the run; failed and cancelled runs end their stream of a run too."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import anyio
import pytest
from lm_support import BACKENDS, small_lm

from ppswap import PipelineError
from ppswap.events import (
    ChunkLoaded,
    ChunkOffloaded,
    EventsDropped,
    RankOrderFinished,
    RunCancelled,
    RunEvent,
    RunEvents,
    RunFailed,
    RunFinished,
    RunStarted,
)


async def _drain(events: RunEvents) -> list[RunEvent]:
    events.close()
    return [event async for event in events]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_swap_run_reports_every_chunk_and_rank_as_it_happens(backend: str) -> None:
    lm = small_lm(backend)
    plain = await lm.run()  # the same run without a stream: the reference
    events = RunEvents()
    seen: list[RunEvent] = []

    async def consume() -> None:
        async for event in events:
            seen.append(event)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        result = await lm.run(events=events)
        events.close()
    assert result.losses == plain.losses  # a stream changes nothing
    assert isinstance(seen[0], RunStarted) and seen[0].ranks == (0, 1) and seen[0].swap
    assert isinstance(seen[-1], RunFinished) and seen[-1].result is result
    assert {event.generation for event in seen} == {result.generation}
    assert not any(isinstance(event, EventsDropped) for event in seen)
    assert events.dropped == 0 and events.emitted == len(seen)
    for stats in result.ranks:
        offloaded = [e for e in seen if isinstance(e, ChunkOffloaded) and e.rank == stats.rank]
        loaded = [e for e in seen if isinstance(e, ChunkLoaded) and e.rank == stats.rank]
        assert sum(e.bytes for e in offloaded) == stats.offloaded_bytes
        assert sum(e.bytes for e in loaded) == stats.loaded_bytes
        assert {(e.stage, e.micro) for e in offloaded} == {(e.stage, e.micro) for e in loaded}
        finished = [e for e in seen if isinstance(e, RankOrderFinished) and e.rank == stats.rank]
        assert len(finished) == 1 and finished[0].steps_executed == stats.steps_executed
    assert sum(s.offloaded_bytes for s in result.ranks) > 0  # chunks really moved
    # each chunk is loaded after it was offloaded
    position = {
        (type(e), e.rank, e.stage, e.micro): n
        for n, e in enumerate(seen)
        if isinstance(e, ChunkOffloaded | ChunkLoaded)
    }
    for (kind, rank, stage, micro), index in position.items():
        if kind is ChunkLoaded:
            assert position[(ChunkOffloaded, rank, stage, micro)] < index


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_slow_consumer_loses_the_oldest_with_a_count_not_the_run(backend: str) -> None:
    lm = small_lm(backend)
    events = RunEvents(capacity=4)
    result = await lm.run(events=events)  # nobody reads during the run: it never waits
    kept = await _drain(events)
    assert events.emitted > 4
    assert kept[0] == EventsDropped(count=events.emitted - 4, time_s=kept[0].time_s)
    assert events.dropped == events.emitted - 4
    assert len(kept) == 5 and isinstance(kept[-1], RunFinished) and kept[-1].result is result


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_cancelled_mid_run_then_the_next_run_finishes(backend: str) -> None:
    lm = small_lm(backend)
    events = RunEvents()
    kinds: list[type[Any]] = []
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:

            async def run_until_cancelled() -> None:
                with anyio.CancelScope() as scope:
                    tg.start_soon(cancel_at_first_offload, scope)
                    await lm.run(events=events)
                assert scope.cancelled_caught

            async def cancel_at_first_offload(scope: anyio.CancelScope) -> None:
                async for event in events:
                    kinds.append(type(event))
                    if isinstance(event, ChunkOffloaded):
                        scope.cancel()
                    if isinstance(event, RunCancelled | RunFinished):
                        return

            tg.start_soon(run_until_cancelled)
    assert kinds[0] is RunStarted and ChunkOffloaded in kinds and kinds[-1] is RunCancelled
    assert RunFinished not in kinds
    result = await lm.run(events=events)  # the same stream serves the next run
    after = Counter(type(event) for event in await _drain(events))
    assert after[RunStarted] == after[RunFinished] == 1 and len(result.losses) == 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_failed_run_ends_with_its_error(backend: str) -> None:
    lm = small_lm(backend)

    def broken_loss(output: Any, target: Any) -> Any:
        raise ArithmeticError("the loss refused this micro-batch")

    lm.model = dataclasses.replace(lm.model, loss_fn=broken_loss)
    events = RunEvents()
    with pytest.raises(PipelineError):
        await lm.run(events=events)
    seen = await _drain(events)
    assert isinstance(seen[0], RunStarted)
    failed = seen[-1]
    assert isinstance(failed, RunFailed) and failed.error_type == "PipelineError"
    assert failed.message.startswith("[rank 1, actor compute, step F0.1]")
    assert failed.message.endswith("the loss refused this micro-batch")


@pytest.mark.asyncio
async def test_the_stream_alone() -> None:
    with pytest.raises(ValueError, match="capacity must be an int >= 1, got 0"):
        RunEvents(capacity=0)
    events = RunEvents(capacity=2)
    assert await events.next_event(timeout_s=0.01) is None  # nothing yet: the deadline
    first = RunCancelled(generation=1)
    events.emit(first)
    assert await events.next_event(timeout_s=1) is first
    async with anyio.create_task_group() as tg:
        tg.start_soon(events.next_event, 5.0)  # waits until the next emit wakes it
        await anyio.sleep(0.01)
        with pytest.raises(RuntimeError, match="one consumer"):
            await events.next_event(0.01)
        events.emit(RunCancelled(generation=2))
    async with events:
        pass
    events.emit(RunCancelled(generation=3))  # after close: ignored
    assert [e async for e in events] == [] and events.closed and events.emitted == 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_stream_that_asks_for_the_timeline_gets_every_actor_s_spans(backend: str) -> None:
    lm = small_lm(backend)
    plain = RunEvents()
    await lm.run(events=plain)
    with_timeline = RunEvents(timeline=True)
    result = await lm.run(events=with_timeline)
    untimed = [e for e in await _drain(plain) if isinstance(e, RunFinished)]
    finished = [e for e in await _drain(with_timeline) if isinstance(e, RunFinished)]
    assert untimed[0].timeline == ()
    spans = finished[0].timeline
    assert finished[0].result is result
    assert [s.start_s for s in spans] == sorted(s.start_s for s in spans)
    assert {(s.rank, s.actor) for s in spans} == {
        (rank, actor) for rank in (0, 1) for actor in ("compute", "copy", "p2p")
    }
    for rank in (0, 1):  # every forward and backward of the rank's 4 micro-batches
        names = [s.name for s in spans if s.rank == rank and s.actor == "compute"]
        assert sorted(n for n in names if n[0] in "FB") == sorted(
            f"{kind}{micro}.{rank}" for kind in "FB" for micro in range(4)
        )
    copies = [s for s in spans if s.actor == "copy"]
    assert len(copies) == sum(stats.copies for stats in result.ranks)
    assert all(s.duration_s >= 0 and s.start_s >= 0 for s in spans)
    with pytest.raises(ValueError, match="timeline must be a bool, got 'yes'"):
        RunEvents(timeline="yes")  # type: ignore[arg-type]
