"""The recompute pass (``scheduler/recompute_plan.py``) and its validation: where each
RECOMPUTE goes, the per-chunk policy in and out, and the orders validation refuses."""

from __future__ import annotations

import dataclasses

import pytest

from ppswap.cli import main
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.planning import planned_orders
from ppswap.scheduler.recompute_plan import (
    chunk_policies,
    inject_recompute_steps,
    orders_for_policies,
    recomputed_chunks,
    strip_recompute_steps,
)
from ppswap.scheduler.steps import (
    BATCH_SEND_RECV,
    CONSUMER_KINDS,
    FSDP_RESHARD,
    FSDP_UNSHARD,
    FWD,
    RECOMPUTE,
    SEND_B,
    SEND_F,
    MetaStep,
    Order,
)
from ppswap.scheduler.validate import ScheduleValidationError, validate_all

CONFIGS = [
    ScheduleConfig(schedule="gpipe", pp=2, micro=4),
    ScheduleConfig(schedule="1f1b", pp=4, micro=8, overlap_b_f=True, split_dw=True),
    ScheduleConfig(schedule="1f1b", pp=2, micro=4, p2p="batch", overlap_b_f=True, swap=True),
    ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=2, micro=4, fsdp=True, swap=True),
    ScheduleConfig(schedule="gpipe", pp=2, micro=4, fsdp=True, p2p="batch"),
    ScheduleConfig(schedule="zbv", pp=2, vpp=2, micro=4),
]


def every_chunk(config: ScheduleConfig) -> tuple[Order, ...]:
    return planned_orders(config, "gap", None, recomputed_chunks(config, range(config.num_stages)))


def _where(order: Order, chunk: tuple[int, int]) -> tuple[int, int, int]:
    """Top-level indices of the chunk's FWD, RECOMPUTE and consumer."""
    found: dict[str, int] = {}
    for index, step in enumerate(order):
        for leaf in step.sub_steps if step.is_compute and step.sub_steps else (step,):
            if leaf.chunk != chunk:
                continue
            if leaf.kind is FWD:
                found["fwd"] = index
            elif leaf.kind is RECOMPUTE:
                found["recompute"] = index
            elif leaf.kind in CONSUMER_KINDS:
                found["consumer"] = index
    return found["fwd"], found["recompute"], found["consumer"]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.schedule}-{c.p2p}-f{c.fsdp:d}")
def test_one_recompute_per_chunk_between_its_fwd_and_its_backward(config: ScheduleConfig) -> None:
    orders = every_chunk(config)
    plain = planned_orders(config)
    for rank, order in enumerate(orders):
        assert strip_recompute_steps(order) == plain[rank]
        policies = chunk_policies(order)
        assert len(policies) == config.micro * len(config.stages_of(rank))
        assert all(p.startswith("recompute") for p in policies.values())
        for chunk in policies:
            fwd, recompute, consumer = _where(order, chunk)
            assert fwd < recompute < consumer
            between = order[recompute + 1 : consumer]
            # nothing but receives and loads between it and its consumer: it overlaps them
            assert not any(s.kind in (SEND_F, SEND_B) for s in between)
            assert not any(
                s.kind is BATCH_SEND_RECV and any(x.kind in (SEND_F, SEND_B) for x in s.sub_steps)
                for s in between
            )
            if config.fsdp:  # the stage's last FSDP step before it is its UNSHARD
                fsdp = [s for s in order[:recompute] if s.stage == chunk[0] and s.micro == -1]
                assert fsdp[-1].kind is FSDP_UNSHARD
                assert not any(
                    s.kind is FSDP_RESHARD and s.stage == chunk[0]
                    for s in order[recompute:consumer]
                )


def test_policies_in_and_out() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, micro=4, swap=True, min_swap_gap=2)
    policies = {(0, 0): "swap", (0, 1): "recompute", (1, 2): "recompute+swap"}
    orders = orders_for_policies(config, policies)  # type: ignore[arg-type]
    validate_all(config, orders)
    read = {**chunk_policies(orders[0]), **chunk_policies(orders[1])}
    assert {c: p for c, p in read.items() if p != "keep"} == policies
    with pytest.raises(ValueError, match=r"policies\[\(0, 0\)\] must be one of"):
        orders_for_policies(config, {(0, 0): "drop"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="needs a config with swap=True"):
        orders_for_policies(dataclasses.replace(config, swap=False), {(0, 0): "swap"})


def test_validation_refuses_a_misplaced_or_repeated_recompute() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, micro=2)
    orders = every_chunk(config)
    order = list(orders[0])
    r = next(i for i, s in enumerate(order) if s.kind is RECOMPUTE)
    step = order[r]

    def refused(new: list[MetaStep], match: str) -> None:
        with pytest.raises(ScheduleValidationError, match=match):
            validate_all(config, (tuple(new), orders[1]))

    refused([step, *order[:r], *order[r + 1 :]], "before the chunk's FWD")
    refused([*order, step], "at most once|no backward after it")
    without = [s for s in order if s is not step]
    refused([*without, step], "no backward after it")
    with pytest.raises(ValueError, match="forward-only"):
        inject_recompute_steps(
            planned_orders(dataclasses.replace(config, forward_only=True))[0],
            dataclasses.replace(config, forward_only=True),
            0,
            {(0, 0)},
        )


def test_ppswap_plan_shows_the_recompute_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--schedule", "1f1b", "--pp", "2", "--micro", "4", "--recompute"]) == 0
    out = capsys.readouterr().out
    assert "R0.0" in out and "RECOMPUTE" in out
