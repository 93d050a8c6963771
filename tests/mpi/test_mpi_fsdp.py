"""FSDP across processes over MPITransport: dp2 x pp, one process per world rank.

``scripts/run_fsdp.py`` under ``mpiexec -n N`` with MindSpore stages: N = 2 is pp1 x dp2,
N = 4 is pp2 x dp2; world rank ``w`` runs pipeline rank ``w % pp`` of replica ``w // pp``.
GPipe and 1F1B, swap off then on. Per world rank and case, compared with the in-process
FSDP run of the same mesh: the losses (mean over dp replicas), the stats' world ranks and
offloaded bytes, the rank's shard gradients and the full gradients gathered across
processes (``gather_full_gradients``) equal bit for bit; swap on equals swap off bit for
bit; losses and full gradients equal the unsplit model on the whole batch (rtol 1e-5).
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import numpy as np
import pytest
from test_mpi_transport import SCRIPTS, launch, needs_mpiexec

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss, unsplit_loss_and_grads
from ppswap.fsdp import DeviceMesh, fsdp_state_of, full_gradients

pytestmark = pytest.mark.mpi

sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fsdp"))
from fsdp_support import DIM, batch, sharded_stages  # noqa: E402
from run_fsdp import BATCH, DP, MICRO, MIN_SWAP_GAP, SCHEDULES, case_name  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


async def _in_process(
    schedule: str, mesh: DeviceMesh, swap: bool
) -> tuple[list[PipelineStage], RunResult]:
    stages = sharded_stages(mesh.pp, mesh)
    x, y = batch(BATCH)
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


@needs_mpiexec
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp_dp2_over_mpi_equals_in_process_and_unsplit(tmp_path: Path, ranks: int) -> None:
    run = launch(ranks, str(SCRIPTS / "run_fsdp.py"), str(tmp_path), timeout_s=200)
    assert run.returncode == 0, run.output[-3000:]
    runs = 2 * len(SCHEDULES)
    for rank in range(ranks):
        assert f"rank {rank} OK: {runs} runs" in run.output, run.output[-3000:]

    mesh = DeviceMesh(pp=ranks // DP, dp=DP)
    x, y = batch(BATCH)
    ref_loss, ref_grads = unsplit_loss_and_grads(build_mlp_stages(mesh.pp, dim=DIM), x, y, mse_loss)
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
                shards = [g.asnumpy() for g in stage.grads]
                full = full_gradients([s for s in stages if s.stage_index == coords.pp])
                assert len(shards) == len(full) == len(ref_grads[coords.pp]), where
                for k, (shard, whole, unsplit) in enumerate(
                    zip(shards, full, ref_grads[coords.pp], strict=True)
                ):
                    np.testing.assert_array_equal(arrays[f"shard_{k}"], shard, err_msg=where)
                    np.testing.assert_array_equal(arrays[f"full_{k}"], whole, err_msg=where)
                    np.testing.assert_allclose(
                        arrays[f"full_{k}"], unsplit, rtol=RTOL, atol=ATOL, err_msg=where
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
