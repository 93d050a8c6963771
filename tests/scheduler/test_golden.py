"""Golden orders: small configs of every family and flag, checked by hand.

Each file in ``golden/`` holds the config, the view (``compute``: compute_order;
``lowered``: build_exec_order), the rule it illustrates, every rank's steps as
``MetaStep.to_dict()`` and the same order as compact text (``short()``) for review. The
``rule`` of each case below says how its order was checked by hand against the Megatron
formulas and the lowering rules (module docstrings of schedules.py and lowering.py).

Regenerate after an intended change with ``python tests/scheduler/test_golden.py
--regen``, then re-check the diff by hand against the rules: a golden file that only
mirrors the code proves nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ppswap.cli import format_json
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_exec_order
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.steps import MetaStep, Order
from ppswap.scheduler.validate import validate_all, validate_order

GOLDEN_DIR = Path(__file__).parent / "golden"

# (name, ScheduleConfig kwargs, view, rule)
CASES: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "gpipe_pp2_m3_plain",
        {"schedule": "gpipe", "pp": 2, "micro": 3},
        "lowered",
        "GPipe: all FWD in micro order then all BWD in micro order. Stage 0 sends SEND_F "
        "after each FWD and receives RECV_B before each BWD; stage 1 (last) receives "
        "RECV_F before each FWD and sends SEND_B after each BWD; peers are the other rank.",
    ),
    (
        "1f1b_pp3_m4_compute",
        {"schedule": "1f1b", "pp": 3, "micro": 4},
        "compute",
        "1F1B warm-up min(pp-r-1, m) = 2, 1, 0: rank 0 F0 F1 | F2 B0 F3 B1 | B2 B3; "
        "rank 1 F0 | F1 B0 F2 B1 F3 B2 | B3; rank 2 (no warm-up) F0 B0 F1 B1 F2 B2 F3 B3.",
    ),
    (
        "1f1b_pp3_m2_compute",
        {"schedule": "1f1b", "pp": 3, "micro": 2},
        "compute",
        "micro < pp: warm-up min(pp-r-1, m) = min(2,2)=2, 1, 0. Rank 0 runs both FWD "
        "then both BWD; rank 1 F0 | F1 B0 | B1; rank 2 F0 B0 F1 B1.",
    ),
    (
        "interleaved_pp2_vpp2_m4_compute",
        {"schedule": "interleaved_1f1b", "pp": 2, "vpp": 2, "micro": 4},
        "compute",
        "Megatron table, groups of pp=2: (m0,c0)(m1,c0)(m0,c1)(m1,c1)(m2,c0)(m3,c0)(m2,c1)"
        "(m3,c1); stage = c*pp + r; backward uses chunk vpp-1-c. Warm-up (pp-r-1)*2 + "
        "(vpp-1)*pp = 4 on rank 0 and 2 on rank 1, then F(w+k) B(k) pairs, then cool-down.",
    ),
    (
        "interleaved_pp2_vpp2_m4_plain",
        {"schedule": "interleaved_1f1b", "pp": 2, "vpp": 2, "micro": 4},
        "lowered",
        "P2P of interleaved: stage 0 has no RECV_F and no SEND_B, stage 3 (last, rank 1) "
        "has no SEND_F and no RECV_B; the wrap-around stage 1 (rank 1) -> stage 2 (rank 0) "
        "uses peer 1 on rank 0 and peer 0 on rank 1. Sends follow their producer, recvs "
        "sit directly before their consumer.",
    ),
    (
        "1f1b_pp3_m3_splitdw_compute",
        {"schedule": "1f1b", "pp": 3, "micro": 3, "split_dw": True},
        "compute",
        "dx/dw split: stage 0 keeps BWD. Weight lag = rank: rank 1 emits W(k-1) after "
        "I(k) (F0 F1 I0 F2 I1 W0 I2 W1 W2), rank 2 emits W0 after I2 and drains "
        "W1 W2 in the cool-down.",
    ),
    (
        "interleaved_pp2_vpp2_m4_splitdw_compute",
        {"schedule": "interleaved_1f1b", "pp": 2, "vpp": 2, "micro": 4, "split_dw": True},
        "compute",
        "Interleaved + split: rank 0 (lag 0) splits stage 2 with W right after I and keeps "
        "BWD on stage 0; rank 1 (lag 2*r = 2) keeps two weights pending: W0.3 comes after "
        "the third backward I0.1, and W2.1 W3.1 drain at the end.",
    ),
    (
        "1f1b_pp2_m3_overlap_plain",
        {"schedule": "1f1b", "pp": 2, "micro": 3, "overlap_b_f": True},
        "lowered",
        "overlap_b_f: each BWD directly followed by a FWD becomes OVERLAP_B_F(BWD, FWD): "
        "rank 0 (warm-up 1) F0 F1 OBF(B0,F2) B1 B2; rank 1 F0 OBF(B0,F1) OBF(B1,F2) B2. "
        "The recvs of both leaves go before the composite, the sends after it.",
    ),
    (
        "1f1b_pp2_m3_overlap_splitdw_plain",
        {"schedule": "1f1b", "pp": 2, "micro": 3, "overlap_b_f": True, "split_dw": True},
        "lowered",
        "overlap + split: the composite holds BWD_INPUT, and its BWD_WEIGHT is the next "
        "compute slot, after the composite's dx send (OBF[I0.1+F1.1] SB0.1 W0.1). Stage 0 "
        "keeps unified BWD inside its composite.",
    ),
    (
        "interleaved_pp2_vpp2_m4_overlap_compute",
        {"schedule": "interleaved_1f1b", "pp": 2, "vpp": 2, "micro": 4, "overlap_b_f": True},
        "compute",
        "Interleaved + overlap: the interleaved order of the compute golden with every "
        "B directly followed by an F fused; the B that ends the steady state (followed by "
        "the cool-down B's) stays alone.",
    ),
    (
        "gpipe_pp2_m2_fsdp_plain",
        {"schedule": "gpipe", "pp": 2, "micro": 2, "fsdp": True},
        "lowered",
        "FSDP on GPipe: one forward run and one backward run per stage. The forward run "
        "starts at slot 0 (UNSHARD first); the backward run follows a slot of the same "
        "stage, so its UNSHARD has no lookahead: sends, RESHARD, UNSHARD, recvs, BWD.",
    ),
    (
        "interleaved_pp2_vpp2_m2_fsdp_batch",
        {
            "schedule": "interleaved_1f1b",
            "pp": 2,
            "vpp": 2,
            "micro": 2,
            "fsdp": True,
            "p2p": "batch",
        },
        "lowered",
        "FSDP lookahead: UN.s2 is placed before F1.0, the slot preceding stage 2's first "
        "use; UN.s0 for the backward run before B1.2. Batch: SF0.2+RF1.2 in one gap are "
        "fused, a lone P2P step stays bare, FSDP steps split a gap's sends from its recvs.",
    ),
    (
        "interleaved_pp1_vpp2_m2_plain",
        {"schedule": "interleaved_1f1b", "pp": 1, "vpp": 2, "micro": 2},
        "lowered",
        "pp=1 interleaved: both stages on rank 0 (warm-up 0*2 + 1*1 = 1); the handoff "
        "stage 0 -> 1 is still a SEND/RECV pair with peer 0 (the own rank).",
    ),
    (
        "1f1b_pp2_m3_forward_only_batch",
        {"schedule": "1f1b", "pp": 2, "micro": 3, "forward_only": True, "p2p": "batch"},
        "lowered",
        "forward_only: FWDs in micro order only, SEND_F/RECV_F only; each gap holds one "
        "P2P step, which stays bare in batch mode.",
    ),
    (
        "1f1b_pp2_m3_batch",
        {"schedule": "1f1b", "pp": 2, "micro": 3, "p2p": "batch"},
        "lowered",
        "batch: the send of one slot and the recv of the next are fused "
        "(BATCH[SF1.0+RB0.0], Megatron's send_forward_recv_backward); lone steps are bare.",
    ),
]


def build_case(kwargs: dict[str, Any], view: str) -> tuple[ScheduleConfig, tuple[Order, ...]]:
    config = ScheduleConfig(**kwargs)
    if view == "compute":
        return config, tuple(compute_order(config, rank) for rank in range(config.pp))
    return config, tuple(build_exec_order(config, rank) for rank in range(config.pp))


def render_case(name: str, kwargs: dict[str, Any], view: str, rule: str) -> dict[str, Any]:
    _, orders = build_case(kwargs, view)
    return {
        "name": name,
        "rule": rule,
        "config": kwargs,
        "view": view,
        "text": [" ".join(step.short() for step in order) for order in orders],
        "ranks": [[step.to_dict() for step in order] for order in orders],
    }


@pytest.mark.parametrize(("name", "kwargs", "view", "rule"), CASES, ids=[c[0] for c in CASES])
def test_golden_order(name: str, kwargs: dict[str, Any], view: str, rule: str) -> None:
    golden = json.loads((GOLDEN_DIR / f"{name}.json").read_text())
    assert golden["config"] == kwargs
    assert golden["view"] == view
    config, orders = build_case(kwargs, view)
    expected = tuple(tuple(MetaStep.from_dict(step) for step in steps) for steps in golden["ranks"])
    assert orders == expected, f"{name}: {rule}"
    # The text form in the file is what was reviewed; it must say the same thing.
    assert golden["text"] == [" ".join(step.short() for step in order) for order in expected]
    if view == "lowered":
        validate_all(config, orders)
    else:
        for rank, order in enumerate(orders):
            validate_order(config, rank, order, lowered=False)


def test_every_golden_file_has_a_case() -> None:
    names = {path.stem for path in GOLDEN_DIR.glob("*.json")}
    assert names == {case[0] for case in CASES}


def _regenerate() -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    for name, kwargs, view, rule in CASES:
        document = render_case(name, kwargs, view, rule)
        (GOLDEN_DIR / f"{name}.json").write_text(format_json(document) + "\n")
        print(f"wrote {name}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regen"]:
        raise SystemExit("usage: python tests/scheduler/test_golden.py --regen")
    _regenerate()
