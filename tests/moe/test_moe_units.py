"""Expert parallelism's pieces: the mesh's EP groups, the in-process all-to-all with
variable splits, and the torch MoE block split over two EP ranks (two real compute
threads, all-to-alls through the P2P actors) against the unsplit block."""

from __future__ import annotations

import copy

import anyio
import numpy as np
import pytest

from ppswap.actors.p2p import P2PActor, p2p_channel
from ppswap.actors.trace import FlightRecorder
from ppswap.core.executor import DedicatedThread, loop_caller
from ppswap.core.transport import AllToAllTransport, is_all_to_all
from ppswap.errors import PipelineError, PipelineHangError
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.moe import ExpertExchange, expert_parallel, expert_state_of
from ppswap.scheduler.steps import MetaStep, StepKind
from ppswap.transports.inprocess import InProcessTransport

torch = pytest.importorskip("torch")
moe_module = pytest.importorskip("ppswap.backends.torch.moe")
MoE = moe_module.MoE


# -- the mesh ---------------------------------------------------------------------------------
def test_mesh_ep_groups_are_replicas_of_one_pipeline_rank() -> None:
    mesh = DeviceMesh(pp=4, dp=2, ep=2)
    assert mesh.world_size == 8
    assert mesh.ep_group(1) == mesh.ep_group(5) == (1, 5)
    assert mesh.coords(5).ep == 1 and mesh.coords(1).ep == 0
    assert mesh.expert_replica_group(5) == (5,)
    wide = DeviceMesh(pp=2, dp=4, ep=2)
    assert wide.ep_group(0) == (0, 2) and wide.ep_group(6) == (4, 6)
    assert wide.expert_replica_group(2) == (2, 6)
    assert wide.expert_replica_group(4) == (0, 4)
    assert repr(DeviceMesh(pp=2, dp=2)) == "DeviceMesh(pp=2, dp=2)"
    assert DeviceMesh(pp=2, dp=2).ep_group(3) == (3,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pp": 2, "dp": 3, "ep": 2}, r"ep must divide dp .*got ep=2 for dp=3"),
        ({"pp": 2, "dp": 2, "ep": 0}, r"DeviceMesh.ep must be an int >= 1, got 0"),
    ],
)
def test_mesh_refuses_an_ep_that_does_not_divide_dp(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DeviceMesh(**kwargs)


# -- the in-process all-to-all -------------------------------------------------------------------
@pytest.mark.asyncio
async def test_in_process_all_to_all_with_random_splits_including_zero() -> None:
    transport = InProcessTransport()
    assert isinstance(transport, AllToAllTransport) and is_all_to_all(transport)
    group = (4, 0, 2)
    rng = np.random.default_rng(7)
    splits = rng.integers(0, 3, size=(3, 3))
    splits[0, 1] = 0  # a zero-size split at least
    sent = {
        rank: [np.full((splits[i, j], 2), 10 * i + j, np.float32) for j in range(3)]
        for i, rank in enumerate(group)
    }
    got: dict[int, list[np.ndarray]] = {}

    async def member(rank: int) -> None:
        for call in range(2):  # one key twice: the n-th calls meet
            got[rank] = await transport.all_to_all(rank, group, "k", sent[rank])
            assert call < 2

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for rank in group:
                tg.start_soon(member, rank)
    for j, rank in enumerate(group):
        for i in range(3):
            np.testing.assert_array_equal(got[rank][i], sent[group[i]][j])
            assert got[rank][i].shape == (splits[i, j], 2)


@pytest.mark.asyncio
async def test_in_process_all_to_all_names_a_peer_whose_rows_differ() -> None:
    transport = InProcessTransport()
    errors: dict[int, str] = {}

    async def member(rank: int, width: int) -> None:
        try:
            await transport.all_to_all(rank, (0, 1), "k", [np.zeros((1, width))] * 2)
        except ValueError as exc:
            errors[rank] = str(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(member, 0, 2)
            tg.start_soon(member, 1, 3)
    assert errors[0].startswith("all_to_all 'k': rank 1 sent rows of (3,) float64, rank 0")
    assert errors[1].startswith("all_to_all 'k': rank 0 sent rows of (2,) float64, rank 1")
    with pytest.raises(ValueError, match="arrays must hold 2 numpy arrays"):
        await transport.all_to_all(0, (0, 1), "k", [np.zeros(1)])


# -- the MoE block -------------------------------------------------------------------------------
def _block(seed: int = 0, experts: int = 4, top_k: int = 2) -> object:
    torch.manual_seed(seed)
    return MoE(8, 16, experts, top_k=top_k)


def test_moe_refuses_bad_arguments_naming_them() -> None:
    with pytest.raises(ValueError, match=r"top_k must be an int in 1..4, got 5"):
        MoE(8, 16, 4, top_k=5)
    with pytest.raises(ValueError, match=r"top_k must be an int >= 1, got 0"):
        MoE(8, 16, 4, top_k=0)
    with pytest.raises(ValueError, match=r"num_experts must be a multiple of mesh.ep=2"):
        expert_parallel(MoE(8, 16, 3, top_k=1), mesh=DeviceMesh(pp=1, dp=2, ep=2), dp_rank=0)
    split = expert_parallel(_block(), mesh=DeviceMesh(pp=1, dp=2, ep=2), dp_rank=1)
    with pytest.raises(ValueError, match="already split by expert_parallel"):
        expert_parallel(split, mesh=DeviceMesh(pp=1, dp=2, ep=2), dp_rank=1)
    with pytest.raises(ValueError, match="module has no MoE block"):
        expert_parallel(torch.nn.Linear(2, 2), mesh=DeviceMesh(pp=1, dp=2, ep=2), dp_rank=0)
    with pytest.raises(ValueError, match=r"dp_rank must be an int in 0..1, got 2"):
        expert_parallel(_block(), mesh=DeviceMesh(pp=1, dp=2, ep=2), dp_rank=2)
    unfit = r"keeps experts 2\.\.3 of 4, which does not fit EP member 0 of 1"
    with pytest.raises(RuntimeError, match=unfit):
        split(torch.randn(3, 8))  # a split block without its EP group


def test_moe_routes_ties_to_the_lower_expert() -> None:
    block = _block()
    with torch.no_grad():
        block.router.weight.zero_()  # every probability equal
    picked, weights = block.route(torch.randn(5, 8))
    assert picked.tolist() == [[0, 1]] * 5
    torch.testing.assert_close(weights, torch.full((5, 2), 0.5))


async def _run_split(
    reference: object, xs: list[object], top_k: int, timeout_s: float = 10.0
) -> tuple[list[object], list[object], list[dict[str, object]], list[int]]:
    """Two EP ranks (dp 0 and 1 of pp=1, dp=2, ep=2), each on its own compute thread:
    forward and backward of its copy on its own batch; outputs, input grads, param grads
    and all-to-all counts per rank."""
    mesh = DeviceMesh(pp=1, dp=2, ep=2)
    transport = InProcessTransport()
    recorder = FlightRecorder()
    step = MetaStep(StepKind.FWD, 0, 0)
    blocks = [expert_parallel(copy.deepcopy(reference), mesh=mesh, dp_rank=r) for r in range(2)]
    outs: list[object] = [None, None]
    dxs: list[object] = [None, None]
    grads: list[dict[str, object]] = [{}, {}]
    exchanges: list[ExpertExchange] = []

    def compute(rank: int) -> None:
        x = xs[rank].clone().requires_grad_(True)
        out = blocks[rank](x)
        out.square().mean().backward()
        outs[rank], dxs[rank] = out.detach(), x.grad
        grads[rank] = {name: p.grad.clone() for name, p in blocks[rank].named_parameters()}

    async with anyio.create_task_group() as tg:
        threads = [DedicatedThread(f"compute-{r}") for r in range(2)]
        channels = []
        for rank in range(2):
            channel, requests = p2p_channel(8)
            actor = P2PActor(rank, transport, requests, recorder, collectives=transport)
            channel.actor = actor
            channels.append(channel)
            tg.start_soon(actor.run)
            exchange = ExpertExchange(
                rank=rank,
                group=mesh.ep_group(rank),
                post=loop_caller(),
                sink=channel,
                where=lambda: step,
                timeout_s=timeout_s,
            )
            exchanges.append(exchange)
            blocks[rank].bind_exchange(exchange)
        try:
            for thread in threads:
                thread.start()
            async with anyio.create_task_group() as work:
                for rank in range(2):
                    work.start_soon(threads[rank].run, compute, rank)
        finally:
            for thread in threads:
                thread.stop()
                await thread.join()
            for channel in channels:
                channel.close()
    return outs, dxs, grads, [e.exchanges for e in exchanges]


@pytest.mark.asyncio
@pytest.mark.parametrize("top_k", [1, 2])
async def test_split_moe_equals_the_unsplit_block(top_k: int) -> None:
    reference = _block(top_k=top_k)
    torch.manual_seed(1)
    xs = [torch.randn(6, 8), torch.randn(5, 8)]
    outs, dxs, grads, exchanges = await _run_split(reference, xs, top_k)
    # 3 in the forward (counts, dispatch, combine), 2 in the backward
    assert exchanges == [5, 5]
    # The unsplit block: each replica's loss alone for its dense grads, their sum for the
    # expert grads (tokens of both replicas reach every expert).
    ref_grads = []
    for rank in range(2):
        block = copy.deepcopy(reference)
        x = xs[rank].clone().requires_grad_(True)
        out = block(x)
        out.square().mean().backward()
        torch.testing.assert_close(outs[rank], out.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dxs[rank], x.grad, rtol=1e-5, atol=1e-6)
        ref_grads.append({name: p.grad for name, p in block.named_parameters()})
    for rank in range(2):
        torch.testing.assert_close(
            grads[rank]["router.weight"], ref_grads[rank]["router.weight"], rtol=1e-5, atol=1e-6
        )
        for name in ("w_in", "w_out"):
            whole = ref_grads[0][name] + ref_grads[1][name]
            mine = whole[rank * 2 : rank * 2 + 2]
            assert grads[rank][name].shape == mine.shape
            torch.testing.assert_close(grads[rank][name], mine, rtol=1e-5, atol=1e-6)
    state = expert_state_of(
        expert_parallel(copy.deepcopy(reference), mesh=DeviceMesh(pp=1, dp=2, ep=2), dp_rank=1)
    )
    assert state is not None and state.ep_rank == 1


@pytest.mark.asyncio
async def test_a_missing_peer_is_a_hang_error_naming_rank_and_step() -> None:
    mesh = DeviceMesh(pp=1, dp=2, ep=2)
    transport = InProcessTransport()
    recorder = FlightRecorder()
    block = expert_parallel(_block(), mesh=mesh, dp_rank=0)
    channel, requests = p2p_channel(8)
    actor = P2PActor(0, transport, requests, recorder, collectives=transport)
    channel.actor = actor
    thread = DedicatedThread("compute")
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(actor.run)
            block.bind_exchange(
                ExpertExchange(
                    rank=0,
                    group=(0, 1),
                    post=loop_caller(),
                    sink=channel,
                    where=lambda: MetaStep(StepKind.FWD, 3, 2),
                    timeout_s=0.2,
                )
            )
            thread.start()
            try:
                with pytest.raises(PipelineHangError) as caught:
                    await thread.run(block, torch.randn(4, 8))
            finally:
                thread.stop()
                await thread.join()
                tg.cancel_scope.cancel()
    assert isinstance(caught.value, PipelineError)
    assert caught.value.rank == 0 and caught.value.step == "F2.3"
    assert "all_to_all moe.counts over ranks (0, 1) not complete within 0.2s" in str(caught.value)
