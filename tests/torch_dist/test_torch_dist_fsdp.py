"""FSDP across processes: dp2 x pp, one process per world rank, over TorchDistTransport.

``scripts/fsdp.py`` under ``torchrun --standalone --nproc_per_node N``: N = 2 is pp1 x dp2,
N = 4 is pp2 x dp2; world rank ``w`` runs pipeline rank ``w % pp`` of replica ``w // pp``.
GPipe and 1F1B, swap off then on. Per world rank and case, compared with the in-process
FSDP run of the same mesh (torch stages from ``tests/torch_backend/torch_support.py``):

- the RunResult: losses (the mean over dp replicas) and loss equal bit for bit, the stats
  of every world rank, with the same offloaded bytes per rank;
- the rank's ``stage.grads`` (its shard gradients) equal the same (stage, replica) of the
  in-process run bit for bit, and the full gradients gathered across processes
  (``gather_full_gradients``) equal ``full_gradients`` of the in-process replicas;
- swap on is bit-identical to swap off; losses and full gradients equal the unsplit torch
  model on the whole batch (rtol 1e-5).

The launch runs in its own process group with a deadline and is killed whole on timeout.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest

pytest.importorskip("torch.distributed")
import torch
from launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch_backend"))
sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from fsdp import BATCH, DP, MICRO, MIN_SWAP_GAP, SCHEDULES, case_name
from torch_support import (
    build_modules,
    make_data,
    mse_loss,
    sharded_stages,
    unsplit_loss_and_grads,
)

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.fsdp import DeviceMesh, fsdp_state_of, full_gradients

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-5, 1e-6


async def _in_process(
    schedule: str, mesh: DeviceMesh, swap: bool
) -> tuple[list[PipelineStage], RunResult]:
    stages = sharded_stages(mesh.pp, mesh)
    x, y = make_data(BATCH)
    result = await run_schedule(
        stages,
        schedule,
        micro_batch_num=MICRO,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=swap,
        min_swap_gap=MIN_SWAP_GAP,
        step_timeout=60.0,
    )
    return stages, result


def _replica(stages: list[PipelineStage], index: int, dp_rank: int) -> PipelineStage:
    (stage,) = (
        s
        for s in stages
        if s.stage_index == index and getattr(fsdp_state_of(s.module), "dp_rank", -1) == dp_rank
    )
    return stage


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch's intra-op threads as in the launched ranks (OMP_NUM_THREADS=1): a CPU kernel
    may split a reduction by thread count, and the comparison is bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_dp2_across_processes_equals_in_process_and_unsplit(
    tmp_path: Path, ranks: int, one_thread: None
) -> None:
    result = launch(ranks, "fsdp.py", str(tmp_path), timeout_s=200)
    assert result.returncode == 0, result.output
    runs = 2 * len(SCHEDULES)
    for rank in range(ranks):
        assert f"rank {rank} OK: {runs} runs" in result.output, result.output

    mesh = DeviceMesh(pp=ranks // DP, dp=DP)
    x, y = make_data(BATCH)
    ref_loss, ref_grads = unsplit_loss_and_grads(build_modules(mesh.pp, wrap=False), x, y)
    moved = 0
    for schedule in SCHEDULES:
        got = {
            swap: [
                dict(np.load(tmp_path / f"{case_name(schedule, swap)}-rank{w}.npz"))
                for w in range(ranks)
            ]
            for swap in (False, True)
        }
        for swap in (False, True):
            stages, reference = anyio.run(_in_process, schedule, mesh, swap)
            for world_rank, arrays in enumerate(got[swap]):
                where = f"{case_name(schedule, swap)} world rank {world_rank}"
                coords = mesh.coords(world_rank)
                assert arrays["losses"].tolist() == reference.losses, where
                assert float(arrays["loss"]) == reference.loss, where
                assert arrays["stat_ranks"].tolist() == list(range(ranks)), where
                offloaded = [r.offloaded_bytes for r in reference.ranks]
                assert arrays["offloaded"].tolist() == offloaded, where
                stage = _replica(stages, coords.pp, coords.dp)
                shards = [g.detach().numpy() for g in stage.grads]
                full = full_gradients([s for s in stages if s.stage_index == coords.pp])
                assert len(shards) == len(full) == len(ref_grads[coords.pp]), where
                for k, (shard, whole, unsplit) in enumerate(
                    zip(shards, full, ref_grads[coords.pp], strict=True)
                ):
                    np.testing.assert_array_equal(arrays[f"shard_{k}"], shard, err_msg=where)
                    np.testing.assert_array_equal(arrays[f"full_{k}"], whole, err_msg=where)
                    np.testing.assert_allclose(
                        arrays[f"full_{k}"], unsplit.numpy(), rtol=RTOL, atol=ATOL, err_msg=where
                    )
                assert float(arrays["loss"]) == pytest.approx(ref_loss, rel=RTOL), where
        for off, on in zip(got[False], got[True], strict=True):
            assert set(off) == set(on)
            for name in off:
                if name != "offloaded":
                    np.testing.assert_array_equal(on[name], off[name], err_msg=name)
            assert not off["offloaded"].any()
        moved += int(got[True][0]["offloaded"].sum())
    assert moved > 0, "the cases must exercise swap"
