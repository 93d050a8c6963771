"""FSDP with one process per world rank, what needs no second process: the per-process
checks refuse bad input before anything runs, and ``gather_full_gradients`` over stand-in
transports (one per world rank, sharing an InProcessTransport's collectives) equals
``full_gradients``. The runs across processes are in ``tests/torch_dist/test_torch_dist_fsdp.py``
(torchrun) and ``tests/mpi/test_mpi_fsdp.py`` (mpiexec)."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
from fsdp_support import batch, sharded_stages

from ppswap import PipelineStage, run_schedule
from ppswap.actors.p2p import InProcessTransport
from ppswap.core.messages import HostArray, MessageKey
from ppswap.core.transport import TransportStats
from ppswap.demo.model import mse_loss
from ppswap.fsdp import DeviceMesh, fsdp_state_of, full_gradients, gather_full_gradients

MESH = DeviceMesh(pp=2, dp=2)


class _P2POnly:
    """A P2P-only transport of a 4-process job (never used: the run is refused first)."""

    rank = 0
    world_size = 4

    async def send(self, src: int, dst: int, key: MessageKey, payload: HostArray) -> None:
        raise AssertionError("must not run")

    async def recv(self, dst: int, src: int, key: MessageKey) -> HostArray:
        raise AssertionError("must not run")

    def stats(self) -> TransportStats:
        return TransportStats(0, 0, 0, 0)


class _Member(_P2POnly):
    """World rank ``rank`` of ``world_size`` processes, with collectives: those of a shared
    InProcessTransport (where every member lives in this event loop)."""

    def __init__(self, rank: int, world_size: int, shared: InProcessTransport | None = None):
        self.rank, self.world_size = rank, world_size
        self._shared = shared or InProcessTransport()

    def configure(self, num_stages: int, micro_count: int) -> None:
        pass

    async def all_gather(
        self, rank: int, group: tuple[int, ...], key: str, array: HostArray
    ) -> list[HostArray]:
        return await self._shared.all_gather(rank, group, key, array)

    async def reduce_scatter_sum(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[HostArray]
    ) -> HostArray:
        return await self._shared.reduce_scatter_sum(rank, group, key, arrays)


def _of(stages: list[PipelineStage], *pairs: tuple[int, int]) -> list[PipelineStage]:
    """The stages with the given (stage index, dp replica) pairs."""
    chosen = []
    for stage in stages:
        state = fsdp_state_of(stage.module)
        assert state is not None
        if (stage.stage_index, state.dp_rank) in pairs:
            chosen.append(stage)
    return chosen


CASES = [
    # (this process's (stage, replica) pairs, run kwargs, error, match)
    (
        [(0, 0)],
        {"transport": _P2POnly()},
        TypeError,
        r"transport must have collectives \(all_gather, reduce_scatter_sum\) and configure "
        r"for fully_shard\(\)-ed stages across processes .*, got _P2POnly",
    ),
    (
        [(0, 0)],
        {"transport": _Member(0, 2)},
        ValueError,
        r"the transport's world size must equal mesh.pp \* mesh.dp = 4 for "
        r"mesh=DeviceMesh\(pp=2, dp=2\) \(one process per world rank\), got world_size=2",
    ),
    (
        [(0, 0)],
        {"transport": _Member(0, 4), "pp": 1, "schedule": "interleaved_1f1b"},
        ValueError,
        r"does not match the run's ranks: mesh.pp \* mesh.dp = 4 ranks need mesh.pp == pp, "
        r"got pp=1",
    ),
    (
        [(1, 1)],  # world rank 1 is pipeline rank 1 of replica 0
        {"transport": _Member(1, 4)},
        ValueError,
        r"stages must be fully_shard\(\)-ed with dp_rank=0 for world rank 1, pipeline rank 1 "
        r"of dp replica 0 \(mesh=DeviceMesh\(pp=2, dp=2\): world rank w is pipeline rank "
        r"w % pp of replica w // pp\), got \(stage, dp_rank\) pairs \[\(1, 1\)\]",
    ),
    (
        [(1, 1)],  # world rank 2 is pipeline rank 0 of replica 1
        {"transport": _Member(2, 4)},
        ValueError,
        r"stages must cover stage indices \[0\] exactly once for world rank 2, pipeline rank 0 "
        r"of dp replica 1 .*, got \[1\]",
    ),
    (
        [(0, 1), (1, 1)],  # both of replica 1's stages on its pipeline rank 0
        {"transport": _Member(2, 4)},
        ValueError,
        r"stages must cover stage indices \[0\] exactly once for world rank 2.*, got \[0, 1\]",
    ),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("pairs", "kwargs", "error", "match"), CASES)
async def test_bad_per_process_fsdp_input_is_refused_before_anything_runs(
    pairs: list[tuple[int, int]], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    stages = _of(sharded_stages(2, MESH), *pairs)
    x, y = batch(8)
    kwargs = {"schedule": "gpipe", **kwargs}
    with pytest.raises(error, match=match):
        await run_schedule(
            stages, micro_batch_num=2, inputs=x, targets=y, loss_fn=mse_loss, **kwargs
        )
    assert all(s.generation == 0 for s in stages)
    assert all(not fsdp_state_of(s.module).unsharded for s in stages)  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_expert_parallelism_across_processes_needs_the_all_to_all() -> None:
    """A transport with FSDP's collectives but no all_to_all is refused for a mesh with
    ep > 1 before anything runs, naming the missing part (core/transport.py's protocols)."""
    mesh = DeviceMesh(pp=2, dp=2, ep=2)
    stages = _of(sharded_stages(2, mesh), (0, 0))
    x, y = batch(8)
    with pytest.raises(TypeError, match=r"transport must have all_to_all .*, got _Member"):
        await run_schedule(
            stages,
            "gpipe",
            micro_batch_num=2,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            transport=_Member(0, 4),
        )
    assert all(s.generation == 0 for s in stages)


@pytest.mark.asyncio
async def test_gather_full_gradients_equals_full_gradients() -> None:
    stages = sharded_stages(2, MESH)
    x, y = batch(8)
    await run_schedule(stages, "gpipe", micro_batch_num=2, inputs=x, targets=y, loss_fn=mse_loss)
    shared = InProcessTransport()
    gathered: dict[tuple[int, int], list[np.ndarray]] = {}

    async def gather(stage: PipelineStage, world_rank: int, replica: int) -> None:
        member = _Member(world_rank, MESH.world_size, shared)
        gathered[(stage.stage_index, replica)] = await gather_full_gradients(stage, member)

    async with anyio.create_task_group() as tg:
        for stage in stages:
            replica = fsdp_state_of(stage.module).dp_rank  # type: ignore[union-attr]
            tg.start_soon(gather, stage, MESH.rank_of(stage.stage_index, replica), replica)
    for index in range(2):
        expected = full_gradients([s for s in stages if s.stage_index == index])
        for replica in range(MESH.dp):
            got = gathered[(index, replica)]
            assert len(got) == len(expected)
            for g, e in zip(got, expected, strict=True):
                np.testing.assert_array_equal(g, e)


@pytest.mark.asyncio
async def test_gather_full_gradients_refuses_the_wrong_replica_and_transport() -> None:
    stages = sharded_stages(2, MESH)
    (replica1,) = _of(stages, (0, 1))
    with pytest.raises(ValueError, match=r"stage 0 is dp replica 1 of mesh=DeviceMesh\(pp=2, "):
        await gather_full_gradients(replica1, _Member(0, 4))  # world rank 0 is replica 0
    with pytest.raises(ValueError, match="of a mesh of 4 ranks"):
        await gather_full_gradients(replica1, _Member(2, 2))
    with pytest.raises(TypeError, match=r"with collectives .*, got _P2POnly"):
        await gather_full_gradients(replica1, _P2POnly())
    with pytest.raises(TypeError, match=r"with collectives .*, got InProcessTransport"):
        await gather_full_gradients(replica1, InProcessTransport())
