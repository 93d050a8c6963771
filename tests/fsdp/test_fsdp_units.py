"""DeviceMesh, fully_shard and the shard state machine, the in-process collectives."""

from __future__ import annotations

import anyio
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from ppswap.actors.p2p import InProcessTransport
from ppswap.core.dtypes import BFLOAT16
from ppswap.core.transport import CollectiveTransport, sum_contributions
from ppswap.fsdp import DeviceMesh, fsdp_state_of, full_parameters, fully_shard
from ppswap.fsdp.mesh import order_for_world_rank
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_exec_order
from ppswap.scheduler.steps import iter_leaves


# -- DeviceMesh --------------------------------------------------------------------------------
def test_mesh_coordinates_and_groups() -> None:
    mesh = DeviceMesh(pp=4, dp=2)
    assert mesh.world_size == 8
    assert mesh.coords(6).pp == 2 and mesh.coords(6).dp == 1
    assert mesh.rank_of(2, 1) == 6
    assert mesh.dp_group(6) == (2, 6)
    assert mesh.dp_group(1) == (1, 5)
    assert mesh.pp_group(6) == (4, 5, 6, 7)
    assert all(mesh.rank_of(mesh.coords(r).pp, mesh.coords(r).dp) == r for r in range(8))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pp": 0, "dp": 2}, ValueError, "DeviceMesh.pp must be an int >= 1, got 0"),
        ({"pp": 2, "dp": True}, TypeError, "DeviceMesh.dp must be an int >= 1, got True"),
        ({"pp": 2.0, "dp": 1}, TypeError, "DeviceMesh.pp"),
    ],
)
def test_mesh_refuses_bad_sizes(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DeviceMesh(**kwargs)  # type: ignore[arg-type]


def test_mesh_refuses_a_rank_outside_it() -> None:
    with pytest.raises(ValueError, match=r"rank must be in 0..3"):
        DeviceMesh(pp=2, dp=2).coords(4)


def test_world_order_moves_peers_into_the_replica() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=2, micro=4, fsdp=True, p2p="batch")
    order = build_exec_order(config, 1)
    mesh = DeviceMesh(pp=2, dp=3)
    assert order_for_world_rank(order, mesh, 1) is order
    moved = order_for_world_rank(order, mesh, 5)  # pipeline rank 1 of replica 2
    peers = [leaf.peer for leaf in iter_leaves(moved) if leaf.peer is not None]
    assert peers and set(peers) == {4}
    assert [leaf.kind for leaf in iter_leaves(moved)] == [leaf.kind for leaf in iter_leaves(order)]


# -- fully_shard --------------------------------------------------------------------------------
def _replicas(dp: int, seed: int = 3) -> list[nn.Cell]:
    modules = []
    for _ in range(dp):
        ms.set_seed(seed)
        np.random.seed(seed)
        modules.append(nn.SequentialCell([nn.Dense(5, 3), nn.Dense(3, 4)]))
    return modules


def test_fully_shard_keeps_padded_dim0_rows_and_full_parameters_rejoin() -> None:
    originals = [p.asnumpy().copy() for p in _replicas(1)[0].trainable_params()]
    mesh = DeviceMesh(pp=1, dp=2)
    replicas = _replicas(2)
    for d, module in enumerate(replicas):
        assert fully_shard(module, mesh=mesh, dp_rank=d) is module
    # Dense(5, 3).weight is (3, 5): 2 rows per shard, replica 1's second row is padding.
    w0 = replicas[0].trainable_params()[0].asnumpy()
    w1 = replicas[1].trainable_params()[0].asnumpy()
    assert w0.shape == w1.shape == (2, 5)
    np.testing.assert_array_equal(w0, originals[0][:2])
    np.testing.assert_array_equal(w1[0], originals[0][2])
    np.testing.assert_array_equal(w1[1], np.zeros(5, np.float32))
    for joined, original in zip(full_parameters(replicas[::-1]), originals, strict=True):
        np.testing.assert_array_equal(joined, original)


def test_fully_shard_refuses_a_module_sharded_twice() -> None:
    mesh = DeviceMesh(pp=1, dp=2)
    module = _replicas(1)[0]
    fully_shard(module, mesh=mesh, dp_rank=0)
    with pytest.raises(ValueError, match="module is already fully_shard"):
        fully_shard(module, mesh=mesh, dp_rank=0)
    parent = nn.SequentialCell([module])
    with pytest.raises(ValueError, match="submodule '0' is already fully_shard"):
        fully_shard(parent, mesh=mesh, dp_rank=0)


def test_fully_shard_refuses_a_submodule_of_a_sharded_module() -> None:
    mesh = DeviceMesh(pp=1, dp=2)
    parent = _replicas(1)[0]
    fully_shard(parent, mesh=mesh, dp_rank=1)
    with pytest.raises(ValueError, match="already sharded by another fully_shard"):
        fully_shard(parent[0], mesh=mesh, dp_rank=1)


@pytest.mark.parametrize(
    ("mesh", "dp_rank", "error", "match"),
    [
        (DeviceMesh(pp=1, dp=2), None, ValueError, "dp_rank must be given when mesh.dp > 1"),
        (DeviceMesh(pp=1, dp=2), 2, ValueError, r"dp_rank must be in 0..1"),
        (DeviceMesh(pp=1, dp=2), "0", TypeError, "dp_rank must be an int"),
        ((1, 2), 0, TypeError, "mesh must be a ppswap.DeviceMesh, got tuple"),
    ],
)
def test_fully_shard_refuses_bad_arguments(
    mesh: object, dp_rank: object, error: type, match: str
) -> None:
    module = _replicas(1)[0]
    before = [p.asnumpy().copy() for p in module.trainable_params()]
    with pytest.raises(error, match=match):
        fully_shard(module, mesh=mesh, dp_rank=dp_rank)  # type: ignore[arg-type]
    assert fsdp_state_of(module) is None
    for param, original in zip(module.trainable_params(), before, strict=True):
        np.testing.assert_array_equal(param.asnumpy(), original)


def test_state_machine_round_trip_and_measured_bytes() -> None:
    """snapshot -> install_full -> reshard: full parameters bit-exact while unsharded, the
    shards again afterwards; the measured bytes follow (about 1/dp between uses)."""
    dp = 2
    mesh = DeviceMesh(pp=1, dp=dp)
    originals = [p.asnumpy().copy() for p in _replicas(1)[0].trainable_params()]
    replicas = _replicas(dp)
    states = []
    for d, module in enumerate(replicas):
        fully_shard(module, mesh=mesh, dp_rank=d)
        state = fsdp_state_of(module)
        assert state is not None
        states.append(state)
    full_bytes = sum(a.nbytes for a in originals)
    assert states[0].full_nbytes == full_bytes
    sharded = states[0].resident_bytes()
    assert sharded == sum(spec.shard_nbytes for spec in states[0].params)
    assert full_bytes // dp <= sharded < full_bytes  # 1/dp, plus the padding rows
    shards = [state.snapshot_shard() for state in states]
    assert states[0].unsharded
    with pytest.raises(RuntimeError, match="already unsharded"):
        states[0].snapshot_shard()
    states[0].install_full(shards)
    for param, original in zip(replicas[0].trainable_params(), originals, strict=True):
        np.testing.assert_array_equal(param.asnumpy(), original)
    assert states[0].resident_bytes() == full_bytes + shards[0].nbytes
    states[0].reshard()
    states[1].reshard()
    assert not states[0].unsharded
    assert states[0].resident_bytes() == sharded
    for joined, original in zip(full_parameters(replicas), originals, strict=True):
        np.testing.assert_array_equal(joined, original)


def test_grad_buckets_and_shard_grads_give_the_mean_of_the_replicas_rows() -> None:
    dp = 2
    mesh = DeviceMesh(pp=1, dp=dp)
    replicas = _replicas(dp)
    for d, module in enumerate(replicas):
        fully_shard(module, mesh=mesh, dp_rank=d)
    rng = np.random.default_rng(0)
    states = [fsdp_state_of(m) for m in replicas]
    params = [list(m.trainable_params()) for m in replicas]
    grads = [
        [rng.standard_normal(spec.full_shape).astype(np.float32) for spec in s.params]  # type: ignore[union-attr]
        for s in states
    ]
    buckets = [
        s.grad_buckets(p, [Tensor(g) for g in gs])  # type: ignore[union-attr]
        for s, p, gs in zip(states, params, grads, strict=True)
    ]
    assert [b.dtype for b in buckets[0]] == ["<f4"]
    for d, (state, replica_params) in enumerate(zip(states, params, strict=True)):
        total = buckets[0][0].contributions[d] + buckets[1][0].contributions[d]
        shard_grads = state.shard_grads(replica_params, buckets[d], [total])  # type: ignore[union-attr]
        for spec, shard_grad, g0, g1 in zip(
            state.params,
            shard_grads,
            grads[0],
            grads[1],
            strict=True,  # type: ignore[union-attr]
        ):
            mean = spec.split((g0 + g1) / 2, dp)[d]
            np.testing.assert_allclose(shard_grad.asnumpy(), mean, rtol=1e-6)
            assert tuple(shard_grad.shape) == spec.shard_shape


# -- in-process collectives ----------------------------------------------------------------------
@pytest.mark.asyncio
async def test_in_process_collectives_gather_in_group_order_and_sum_left_to_right() -> None:
    transport = InProcessTransport()
    assert isinstance(transport, CollectiveTransport)
    group = (5, 1, 3)
    gathered: dict[int, list[np.ndarray]] = {}
    reduced: dict[int, np.ndarray] = {}

    async def member(rank: int) -> None:
        gathered[rank] = await transport.all_gather(rank, group, "k", np.array([rank]))
        arrays = [np.full(2, 10.0 * rank + j, np.float32) for j in range(3)]
        reduced[rank] = await transport.reduce_scatter_sum(rank, group, "k", arrays)

    async with anyio.create_task_group() as tg:
        for rank in group:
            tg.start_soon(member, rank)
    for rank in group:
        assert [int(a[0]) for a in gathered[rank]] == [5, 1, 3]
        index = group.index(rank)
        np.testing.assert_array_equal(reduced[rank], np.full(2, 90.0 + 3 * index, np.float32))


@pytest.mark.asyncio
async def test_in_process_collectives_match_repeated_keys_by_call_count() -> None:
    transport = InProcessTransport()
    group = (0, 1)
    seen: dict[int, list[list[int]]] = {0: [], 1: []}

    async def member(rank: int) -> None:
        for call in range(3):
            found = await transport.all_gather(rank, group, "same", np.array([rank * 10 + call]))
            seen[rank].append([int(a[0]) for a in found])

    async with anyio.create_task_group() as tg:
        tg.start_soon(member, 0)
        tg.start_soon(member, 1)
    assert seen[0] == seen[1] == [[0, 10], [1, 11], [2, 12]]


@pytest.mark.asyncio
async def test_in_process_collectives_refuse_members_that_disagree() -> None:
    transport = InProcessTransport()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(transport.all_gather, 0, (0, 1), "k", np.zeros(1))
            await anyio.sleep(0)
            with pytest.raises(RuntimeError, match="disagree on the group order"):
                await transport.all_gather(1, (1, 0), "k", np.zeros(1))
            tg.cancel_scope.cancel()
    with pytest.raises(ValueError, match=r"must hold distinct ranks including this rank 2"):
        await transport.all_gather(2, (0, 1), "k", np.zeros(1))
    with pytest.raises(ValueError, match="arrays must hold 2 numpy arrays"):
        await transport.reduce_scatter_sum(0, (0, 1), "k", [np.zeros(1)])


def test_contributions_sum_left_to_right_and_a_mismatch_names_its_sender() -> None:
    """The reduction every transport's reduce_scatter_sum ends with (core.transport)."""
    parts = [np.array([1e8], np.float32), np.array([-1e8], np.float32), np.array([1.0], np.float32)]
    total = sum_contributions("k", (4, 2, 7), 2, parts)
    assert total.tolist() == [1.0]  # (p0 + p1) + p2; p0 + (p1 + p2) rounds to 0 in float32
    assert total is not parts[0] and parts[0][0] == 1e8  # a new array
    bad = [*parts[:2], np.zeros(2, np.float32)]
    with pytest.raises(ValueError, match=r"'k': rank 7 sent \(2,\) float32, rank 2 expects"):
        sum_contributions("k", (4, 2, 7), 2, bad)


def test_bfloat16_contributions_of_either_numpy_type_sum_alike() -> None:
    """MindSpore's own numpy bfloat16 (this rank's part) and ml_dtypes' (what the wire
    delivers) sum as ml_dtypes', rounded to bfloat16 at each step, into this rank's type."""
    assert BFLOAT16 is not None
    values = [np.array([1.0, 3.0, -2.5]), np.array([0.00390625, 1.0, 2.5]), np.array([1.0] * 3)]
    carried = [v.astype(np.float32).astype(BFLOAT16) for v in values]
    theirs = ms.Tensor(values[1].astype(np.float32)).astype(ms.bfloat16).asnumpy()
    assert theirs.dtype != BFLOAT16
    mixed = [carried[0], theirs, carried[2]]
    total = sum_contributions("k", (4, 2, 7), 2, mixed)
    assert total.dtype == theirs.dtype
    expected = (carried[0] + carried[1]) + carried[2]  # 1 + 2**-8 rounds to 1 in bfloat16
    assert total.view(np.uint16).tolist() == expected.view(np.uint16).tolist()
    assert sum_contributions("k", (4, 2, 7), 4, carried).dtype == BFLOAT16
