"""ppswap's Looped BFS, Interleaved Zero Bubble, ZBV and DualPipeV orders against
torch.distributed.pipelining's own.

torch's schedule classes build every rank's order (``pipeline_order``) in their
constructors; built with stand-in stages (the constructors read only the stages' indices
and group size, as in ``test_torch_orders.py``), each rank's order equals ppswap's
``compute_order`` action for action (F, I, W, B, and DualPipeV's OVERLAP_F_B pairs with
their sub-actions in order), for pp 2 to 8 and micro-batch counts at and above each
family's minimum. ppswap refuses exactly the configurations torch's constructors refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

from ppswap.scheduler.config import ScheduleConfig  # noqa: E402
from ppswap.scheduler.schedules import compute_order  # noqa: E402
from ppswap.scheduler.user_orders import read_orders, write_csv  # noqa: E402

TORCH_CLASSES = {
    "looped_bfs": schedules.ScheduleLoopedBFS,
    "interleaved_zb": schedules.ScheduleInterleavedZeroBubble,
    "zbv": schedules.ScheduleZBVZeroBubble,
    "dualpipev": schedules.ScheduleDualPipeV,
}
V_SHAPED = {"zbv", "dualpipev"}


@dataclass
class StandInStage:
    """What torch's multi-stage schedules read from a stage to build their orders."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    stage_index_to_group_rank: dict[int, int] | None = None
    submod: Any = None


def _short(action: Any) -> str:
    """A torch action written as ppswap writes a compute slot (``MetaStep.short``)."""
    if action.sub_actions is not None:
        return "OFB[" + "+".join(_short(sub) for sub in action.sub_actions) + "]"
    kind = action.computation_type.value  # F, I, W or B: ppswap's letters too
    return f"{kind}{action.microbatch_index}.{action.stage_index}"


def torch_orders(schedule: str, pp: int, vpp: int, micro: int) -> dict[int, list[str]]:
    num_stages = pp * vpp
    indices = [0, num_stages - 1] if schedule in V_SHAPED else [c * pp for c in range(vpp)]
    stages = [StandInStage(index, num_stages, pp, 0) for index in indices]
    built = TORCH_CLASSES[schedule](cast(Any, stages), micro)
    return {
        rank: [_short(action) for action in actions if action is not None]
        for rank, actions in built.pipeline_order.items()
    }


def ppswap_orders(schedule: str, pp: int, vpp: int, micro: int) -> dict[int, list[str]]:
    config = ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=micro)  # type: ignore[arg-type]
    return {rank: [step.short() for step in compute_order(config, rank)] for rank in range(pp)}


def _micro_counts(schedule: str, pp: int) -> list[int]:
    if schedule == "dualpipev":
        return [2 * pp, 2 * pp + 1, 3 * pp]
    if schedule == "zbv":
        return [1, pp, 2 * pp - 1, 2 * pp, 3 * pp + 1]
    if schedule == "interleaved_zb":
        counts = (1, pp - 1, pp, pp + 1, 2 * pp, 3 * pp)
        return [m for m in counts if m >= 1 and m % max(1, m // pp) == 0]
    return [1, pp, 2 * pp + 1]


@pytest.mark.parametrize("schedule", sorted(TORCH_CLASSES))
@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
def test_orders_are_torchs(schedule: str, pp: int) -> None:
    vpps = [2] if schedule in V_SHAPED else [1, 2, 3]
    for vpp in vpps:
        for micro in _micro_counts(schedule, pp):
            want = torch_orders(schedule, pp, vpp, micro)
            got = ppswap_orders(schedule, pp, vpp, micro)
            assert sorted(want) == list(range(pp))
            for rank in range(pp):
                assert got[rank] == want[rank], (schedule, pp, vpp, micro, rank)


@pytest.mark.parametrize("schedule", sorted(TORCH_CLASSES))
def test_refused_exactly_where_torch_refuses(schedule: str) -> None:
    for pp in (1, 2, 3, 4):
        for vpp in (1, 2, 3):
            for micro in range(1, 13):
                # torch's V classes check len(stages) == 2: the stand-ins hold one V only
                torch_accepts = schedule not in V_SHAPED or vpp == 2
                if torch_accepts:
                    try:
                        torch_orders(schedule, pp, vpp, micro)
                    except ValueError:
                        torch_accepts = False
                try:
                    ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=micro)  # type: ignore[arg-type]
                    ppswap_accepts = True
                except ValueError:
                    ppswap_accepts = False
                assert ppswap_accepts == torch_accepts, (schedule, pp, vpp, micro)


@pytest.mark.parametrize("schedule", sorted(TORCH_CLASSES))
def test_torchs_csv_reads_as_ppswaps_orders(schedule: str, tmp_path: Path) -> None:
    """The CSV torch writes (``_dump_csv(format="compute_only")``, bubbles as empty cells)
    read by ``read_orders`` gives ppswap's orders; ppswap's CSV loads into torch."""
    pp, vpp, micro = 3, 2, 6
    num_stages = pp * vpp
    indices = [0, num_stages - 1] if schedule in V_SHAPED else [c * pp for c in range(vpp)]
    stages = [StandInStage(index, num_stages, pp, 0) for index in indices]
    built = TORCH_CLASSES[schedule](cast(Any, stages), micro)
    path = tmp_path / "torch.csv"
    built._dump_csv(str(path), format="compute_only")
    config = ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=micro)  # type: ignore[arg-type]
    ours = tuple(compute_order(config, rank) for rank in range(pp))
    assert read_orders(path) == ours
    mine = tmp_path / "ppswap.csv"
    write_csv(ours, mine)
    built._load_csv(str(mine), format="compute_only")
    assert {
        rank: [_short(a) for a in row if a is not None]
        for rank, row in built.pipeline_order.items()
    } == ppswap_orders(schedule, pp, vpp, micro)
