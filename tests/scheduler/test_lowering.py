"""Lowering passes: FSDP placement, P2P rules and modes, purity, the swap hook."""

from __future__ import annotations

import copy

import pytest

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import (
    build_all_orders,
    build_exec_order,
    inject_fsdp_steps,
    rewrite_p2p,
    unshard_index_for,
)
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.steps import (
    COMPOSITE_KINDS,
    COMPUTE_KINDS,
    SWAP_KINDS,
    MetaStep,
    Order,
    StepKind,
    iter_leaves,
)
from ppswap.scheduler.validate import validate_all

K = StepKind
UN, RE = K.FSDP_UNSHARD, K.FSDP_RESHARD


def is_slot(step: MetaStep) -> bool:
    return step.kind in COMPUTE_KINDS or step.kind in COMPOSITE_KINDS


def slot_stages(step: MetaStep) -> set[int]:
    return {leaf.stage for leaf in (step.sub_steps or (step,))}


def text(order: Order) -> str:
    return " ".join(step.short() for step in order)


# -- FSDP ----------------------------------------------------------------------------------------
def reference_runs(compute: Order, stage: int) -> list[tuple[int, int]]:
    """Use runs of ``stage`` from the rule text, the slow obvious way: (start, end)."""
    uses = [i for i, slot in enumerate(compute) if stage in slot_stages(slot)]
    first_backward = (
        next(
            i
            for i, slot in enumerate(compute)
            for leaf in (slot.sub_steps or (slot,))
            if leaf.stage == stage and leaf.kind in (K.BWD, K.BWD_INPUT)
        )
        if any(
            leaf.stage == stage and leaf.kind in (K.BWD, K.BWD_INPUT)
            for slot in compute
            for leaf in (slot.sub_steps or (slot,))
        )
        else None
    )
    runs: list[tuple[int, int]] = []
    for index in uses:
        if runs and runs[-1][1] == index - 1 and index != first_backward:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


FSDP_CONFIGS = [
    {"schedule": "gpipe", "pp": 2, "micro": 3},
    {"schedule": "1f1b", "pp": 3, "micro": 5},
    {"schedule": "1f1b", "pp": 2, "micro": 4, "overlap_b_f": True, "split_dw": True},
    {"schedule": "interleaved_1f1b", "pp": 2, "vpp": 3, "micro": 4},
    {"schedule": "interleaved_1f1b", "pp": 3, "vpp": 2, "micro": 6, "overlap_b_f": True},
    {"schedule": "interleaved_1f1b", "pp": 1, "vpp": 3, "micro": 2, "split_dw": True},
    {"schedule": "1f1b", "pp": 2, "micro": 3, "forward_only": True},
]


@pytest.mark.parametrize("kwargs", FSDP_CONFIGS)
def test_fsdp_steps_follow_the_use_run_rules(kwargs: dict[str, object]) -> None:
    config = ScheduleConfig(fsdp=True, **kwargs)  # type: ignore[arg-type]
    for rank in range(config.pp):
        compute = compute_order(config, rank)
        order = inject_fsdp_steps(compute, config, rank)
        assert tuple(s for s in order if is_slot(s)) == compute
        # top-level index of each compute slot
        slot_at = [i for i, s in enumerate(order) if is_slot(s)]
        for stage in config.stages_of(rank):
            runs = reference_runs(compute, stage)
            unshards = [i for i, s in enumerate(order) if s.kind is UN and s.stage == stage]
            reshards = [i for i, s in enumerate(order) if s.kind is RE and s.stage == stage]
            assert len(unshards) == len(reshards) == len(runs)
            for (start, end), un, re in zip(runs, unshards, reshards, strict=True):
                # RESHARD: in the gap right after the run's last slot
                after = slot_at[end + 1] if end + 1 < len(slot_at) else len(order)
                assert slot_at[end] < re < after
                # UNSHARD: lookahead before slot start-1 unless it uses the stage
                lookahead = start > 0 and stage not in slot_stages(compute[start - 1])
                host = start - 1 if lookahead else start
                before = slot_at[host - 1] if host > 0 else -1
                assert before < un < slot_at[host], (stage, start, host)
            # UNSHARD never precedes the same stage's previous RESHARD
            for previous_re, next_un in zip(reshards, unshards[1:], strict=False):
                assert previous_re < next_un


def test_fsdp_gpipe_gets_a_forward_and_a_backward_run() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, micro=2, fsdp=True)
    order = inject_fsdp_steps(compute_order(config, 0), config, 0)
    assert text(order) == "UN.s0 F0.0 F1.0 RE.s0 UN.s0 B0.0 B1.0 RE.s0"


def test_fsdp_lookahead_orders_a_gap_as_sends_reshard_unshard_recvs() -> None:
    # Rank 1 of interleaved pp=2 vpp=2 m=2: stage 1's backward run opens at B0.1 and its
    # UNSHARD is hoisted before B1.3; stage 3 has no lookahead at its first backward.
    config = ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=2, micro=2, fsdp=True)
    assert text(build_exec_order(config, 1)) == (
        "UN.s1 RF0.1 F0.1 SF0.1 UN.s3 RF1.1 F1.1 SF1.1 RE.s1 RF0.3 F0.3 RE.s3 UN.s3 B0.3 "
        "SB0.3 RF1.3 F1.3 UN.s1 B1.3 SB1.3 RE.s3 RB0.1 B0.1 SB0.1 RB1.1 B1.1 SB1.1 RE.s1"
    )


def test_inject_fsdp_is_identity_without_fsdp_and_refuses_lowered_input() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=2, micro=2)
    compute = compute_order(config, 0)
    assert inject_fsdp_steps(compute, config, 0) is compute
    lowered = build_exec_order(config, 0)
    with pytest.raises(ValueError, match="compute order"):
        inject_fsdp_steps(lowered, ScheduleConfig(schedule="1f1b", pp=2, micro=2, fsdp=True), 0)


@pytest.mark.parametrize("kwargs", FSDP_CONFIGS[:5])
def test_unshard_index_for_finds_the_unshard_that_opens_a_run(kwargs: dict[str, object]) -> None:
    config = ScheduleConfig(fsdp=True, **kwargs)  # type: ignore[arg-type]
    for rank in range(config.pp):
        order = build_exec_order(config, rank)
        compute = compute_order(config, rank)
        slot_at = [i for i, s in enumerate(order) if is_slot(s)]
        for slot_index, index in enumerate(slot_at):
            stage = (order[index].sub_steps or (order[index],))[0].stage
            opens = any(start == slot_index for start, _ in reference_runs(compute, stage))
            found = unshard_index_for(order, index)
            if opens:
                assert found is not None
                assert order[found] == MetaStep(UN, stage, -1)
                # it is the last FSDP step of that stage before the consumer
                between = [s for s in order[found + 1 : index] if s.kind in (UN, RE)]
                assert all(s.stage != stage for s in between)
            else:
                assert found is None


def test_unshard_index_for_refuses_a_non_compute_index() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=2, micro=2, fsdp=True)
    order = build_exec_order(config, 0)
    with pytest.raises(ValueError, match="compute slot"):
        unshard_index_for(order, 0)
    with pytest.raises(ValueError, match="consumer_index"):
        unshard_index_for(order, len(order))


# -- P2P -------------------------------------------------------------------------------------------
def test_p2p_peers_and_directions_follow_the_stage_rules() -> None:
    config = ScheduleConfig(schedule="interleaved_1f1b", pp=3, vpp=2, micro=3)
    last = config.num_stages - 1
    for rank in range(3):
        order = build_exec_order(config, rank)
        for index, step in enumerate(order):
            s, i = step.stage, step.micro
            if step.kind is K.FWD:
                if s > 0:
                    assert MetaStep(K.RECV_F, s, i, (s - 1) % 3) in order[:index]
                if s < last:
                    assert order[index + 1] == MetaStep(K.SEND_F, s, i, (s + 1) % 3)
                else:
                    assert all(x.kind is not K.SEND_F or x.stage != s for x in order)
            if step.kind is K.BWD:
                if s < last:
                    assert order[index - 1] == MetaStep(K.RECV_B, s, i, (s + 1) % 3)
                if s > 0:
                    assert order[index + 1] == MetaStep(K.SEND_B, s, i, (s - 1) % 3)
            if step.kind in (K.RECV_F, K.RECV_B):
                # a recv sits directly before its consumer
                consumer = order[index + 1]
                assert consumer.chunk == step.chunk and consumer.kind in (K.FWD, K.BWD)


def test_composite_gets_both_recvs_before_and_both_sends_after() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=3, micro=4, overlap_b_f=True)
    order = build_exec_order(config, 1)
    index = next(i for i, s in enumerate(order) if s.kind is K.OVERLAP_B_F)
    back, fwd = order[index].sub_steps
    assert order[index - 2 : index] == (
        MetaStep(K.RECV_B, 1, back.micro, 2),
        MetaStep(K.RECV_F, 1, fwd.micro, 0),
    )
    assert order[index + 1 : index + 3] == (
        MetaStep(K.SEND_B, 1, back.micro, 0),
        MetaStep(K.SEND_F, 1, fwd.micro, 2),
    )


def test_split_weight_follows_the_dx_send() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=2, micro=3, overlap_b_f=True, split_dw=True)
    assert "OBF[I0.1+F1.1] SB0.1 W0.1" in text(build_exec_order(config, 1))


def flatten_batches(order: Order) -> Order:
    out: list[MetaStep] = []
    for step in order:
        out.extend(step.sub_steps if step.kind is K.BATCH_SEND_RECV else (step,))
    return tuple(out)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"schedule": "1f1b", "pp": 4, "micro": 6},
        {"schedule": "interleaved_1f1b", "pp": 2, "vpp": 2, "micro": 4, "fsdp": True},
        {"schedule": "1f1b", "pp": 3, "micro": 5, "overlap_b_f": True, "fsdp": True},
    ],
)
def test_modes_share_positions(kwargs: dict[str, object]) -> None:
    plain = ScheduleConfig(p2p="plain", **kwargs)  # type: ignore[arg-type]
    batch = ScheduleConfig(p2p="batch", **kwargs)  # type: ignore[arg-type]
    boundary = ScheduleConfig(p2p="boundary", **kwargs)  # type: ignore[arg-type]
    fused = 0
    for rank in range(plain.pp):
        plain_order = build_exec_order(plain, rank)
        batch_order = build_exec_order(batch, rank)
        assert build_exec_order(boundary, rank) == plain_order
        assert flatten_batches(batch_order) == plain_order
        for step in batch_order:
            if step.kind is K.BATCH_SEND_RECV:
                assert len(step.sub_steps) >= 2
                assert step.chunk == step.sub_steps[0].chunk
                fused += 1
    assert fused > 0


def test_same_rank_handoff_keeps_a_send_recv_pair_with_own_rank_as_peer() -> None:
    config = ScheduleConfig(schedule="interleaved_1f1b", pp=1, vpp=3, micro=2)
    order = build_exec_order(config, 0)
    p2p = [s for s in order if s.kind in (K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B)]
    assert p2p and all(s.peer == 0 for s in p2p)
    assert sum(s.kind is K.SEND_F for s in p2p) == 2 * 2  # stages 0, 1 send, 2 micro-batches
    validate_all(config, (order,))


def test_rewrite_p2p_refuses_an_order_that_already_has_p2p() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=2, micro=2)
    with pytest.raises(ValueError, match="without P2P steps"):
        rewrite_p2p(build_exec_order(config, 0), config, 0)


# -- purity, determinism, the pipeline ------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {
            "schedule": "interleaved_1f1b",
            "pp": 2,
            "vpp": 2,
            "micro": 4,
            "fsdp": True,
            "p2p": "batch",
        },
        {
            "schedule": "1f1b",
            "pp": 3,
            "micro": 4,
            "overlap_b_f": True,
            "split_dw": True,
            "fsdp": True,
        },
    ],
)
def test_passes_do_not_mutate_and_do_not_keep_state(kwargs: dict[str, object]) -> None:
    config = ScheduleConfig(**kwargs)  # type: ignore[arg-type]
    other = ScheduleConfig(schedule="gpipe", pp=4, micro=3, fsdp=True)
    for rank in range(config.pp):
        compute = compute_order(config, rank)
        snapshot = copy.deepcopy(compute)
        with_fsdp = inject_fsdp_steps(compute, config, rank)
        assert compute == snapshot
        fsdp_snapshot = copy.deepcopy(with_fsdp)
        lowered = rewrite_p2p(with_fsdp, config, rank)
        assert with_fsdp == fsdp_snapshot
        build_all_orders(other)  # unrelated work in between must not change anything
        assert inject_fsdp_steps(compute, config, rank) == with_fsdp
        assert rewrite_p2p(with_fsdp, config, rank) == lowered
        assert build_exec_order(config, rank) == lowered


def strip_swap(order: Order) -> Order:
    return tuple(step for step in order if step.kind not in SWAP_KINDS)


def test_swap_is_the_last_pass_and_only_adds_swap_steps() -> None:
    kwargs = {"schedule": "gpipe", "pp": 2, "micro": 6, "fsdp": True, "p2p": "batch"}
    without = ScheduleConfig(**kwargs)  # type: ignore[arg-type]
    with_swap = ScheduleConfig(swap=True, **kwargs)  # type: ignore[arg-type]
    orders = build_all_orders(with_swap)
    assert any(step.kind in SWAP_KINDS for order in orders for step in order)
    assert tuple(strip_swap(order) for order in orders) == build_all_orders(without)
    # swap steps are top-level only
    for order in orders:
        for step in order:
            assert all(sub.kind not in SWAP_KINDS for sub in iter_leaves(step.sub_steps))
    validate_all(with_swap, orders)


def test_build_all_orders_is_indexed_by_rank() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=3, micro=3)
    orders = build_all_orders(config)
    assert orders == tuple(build_exec_order(config, rank) for rank in range(3))
    with pytest.raises(ValueError, match="rank"):
        build_exec_order(config, 3)
