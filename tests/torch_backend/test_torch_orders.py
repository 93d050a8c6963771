"""ppswap's interleaved compute orders against torch.distributed.pipelining's own.

``ScheduleInterleaved1F1B`` builds every rank's order of forwards and backwards
(``pipeline_order``) in its constructor, and its runtime runs that order. Built with
stand-in stages (the constructor reads only their indices and the group size; no process
group is needed, as in ``benchmarks/bench_plan.py``), its order for every rank equals
ppswap's ``compute_order``, action for action, for pp 2 to 8, vpp 2 to 4 and micro-batch
counts that are multiples of pp (what ppswap's interleaved schedule accepts). GPipe's and
1F1B's orders are the step code of torch's single-stage schedules, so they are compared
where torch runs them: ``tests/torch_dist/scripts/peer_pipelining.py`` records the order
of its stages' calls under torchrun (``test_torch_peer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

from ppswap.scheduler.config import ScheduleConfig  # noqa: E402
from ppswap.scheduler.schedules import compute_order  # noqa: E402


@dataclass
class StandInStage:
    """What torch's multi-stage schedules read from a stage to build their orders."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    stage_index_to_group_rank: dict[int, int] | None = None


def torch_orders(pp: int, vpp: int, micro: int) -> dict[int, list[str]]:
    """Every rank's forwards and backwards in torch's ``pipeline_order`` (no bubbles),
    written as ppswap writes a compute step (``MetaStep.short``: ``F3.0``)."""
    stages = [StandInStage(chunk * pp, pp * vpp, pp, 0) for chunk in range(vpp)]
    built = schedules.ScheduleInterleaved1F1B(cast(Any, stages), micro)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return {
        rank: [
            f"{kinds[action.computation_type.name]}{action.microbatch_index}.{action.stage_index}"
            for action in actions
            if action is not None
        ]
        for rank, actions in built.pipeline_order.items()
    }


def ppswap_orders(pp: int, vpp: int, micro: int) -> dict[int, list[str]]:
    config = ScheduleConfig(schedule="interleaved_1f1b", pp=pp, vpp=vpp, micro=micro)
    return {rank: [step.short() for step in compute_order(config, rank)] for rank in range(pp)}


@pytest.mark.parametrize("vpp", [2, 3, 4])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_interleaved_orders_are_torchs(pp: int, vpp: int) -> None:
    for micro in (pp, 2 * pp, 3 * pp, 4 * pp):
        want = torch_orders(pp, vpp, micro)
        got = ppswap_orders(pp, vpp, micro)
        assert sorted(want) == list(range(pp))
        for rank in range(pp):
            assert len(got[rank]) == 2 * vpp * micro
            assert got[rank] == want[rank], (pp, vpp, micro, rank)
