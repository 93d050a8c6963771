"""The four swap steps' anchors, their order with FSDP, P2P and dx/dw, and with overlap.

Hand-built orders with communication, FSDP and composites; each expected order was worked
out by hand from the placement rules in ``ppswap.scheduler.swap_plan``.
"""

from __future__ import annotations

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import MetaStep, Order, StepKind
from ppswap.scheduler.swap_plan import chunks_on_host_peak, inject_swap_steps, strip_swap_steps

K = StepKind


def fwd(stage: int, micro: int) -> MetaStep:
    return MetaStep(K.FWD, stage, micro)


def bwd(stage: int, micro: int) -> MetaStep:
    return MetaStep(K.BWD, stage, micro)


def p2p(kind: StepKind, stage: int, micro: int, peer: int) -> MetaStep:
    return MetaStep(kind, stage, micro, peer=peer)


def batch(*steps: MetaStep) -> MetaStep:
    return MetaStep(K.BATCH_SEND_RECV, steps[0].stage, steps[0].micro, sub_steps=steps)


def unshard(stage: int) -> MetaStep:
    return MetaStep(K.FSDP_UNSHARD, stage, -1)


def reshard(stage: int) -> MetaStep:
    return MetaStep(K.FSDP_RESHARD, stage, -1)


def text(order: Order) -> str:
    return " ".join(s.short() for s in order)


def names(order: Order) -> list[str]:
    return [s.short() for s in order]


# Rank 0 of a 2-rank GPipe, m=4, plain P2P: sends after each FWD, recvs before each BWD.
GPIPE_PLAIN: Order = tuple(
    s for i in range(4) for s in (fwd(0, i), p2p(K.SEND_F, 0, i, 1))
) + tuple(s for i in range(4) for s in (p2p(K.RECV_B, 0, i, 1), bwd(0, i)))

# The same with batch P2P: the sends/recvs between two computes fused into one container.
GPIPE_BATCH: Order = (
    fwd(0, 0),
    batch(p2p(K.SEND_F, 0, 0, 1)),
    fwd(0, 1),
    batch(p2p(K.SEND_F, 0, 1, 1)),
    fwd(0, 2),
    batch(p2p(K.SEND_F, 0, 2, 1)),
    fwd(0, 3),
    batch(p2p(K.SEND_F, 0, 3, 1), p2p(K.RECV_B, 0, 0, 1)),
    bwd(0, 0),
    batch(p2p(K.RECV_B, 0, 1, 1)),
    bwd(0, 1),
    batch(p2p(K.RECV_B, 0, 2, 1)),
    bwd(0, 2),
    batch(p2p(K.RECV_B, 0, 3, 1)),
    bwd(0, 3),
)

PP2 = ScheduleConfig(schedule="gpipe", pp=2, micro=4, swap=True)
PP2_BATCH = ScheduleConfig(schedule="gpipe", pp=2, micro=4, swap=True, p2p="batch")


def test_plain_p2p_golden() -> None:
    assert text(inject_swap_steps(GPIPE_PLAIN, PP2, 0)) == (
        "F0.0 SF0.0 LO0.0 F1.0 SF1.0 LO1.0 WO0.0 F2.0 SF2.0 LO2.0 WO1.0 LL0.0 "
        "F3.0 SF3.0 LO3.0 WO2.0 LL1.0 RB0.0 WL0.0 B0.0 WO3.0 LL2.0 RB1.0 WL1.0 B1.0 "
        "LL3.0 RB2.0 WL2.0 B2.0 RB3.0 WL3.0 B3.0"
    )


def test_launch_offload_right_after_fwd_and_its_sends() -> None:
    # The send goes first: launching the offload runs a prepare job on the compute thread,
    # which must not hold the activation back from the next stage.
    out = names(inject_swap_steps(GPIPE_PLAIN, PP2, 0))
    for i in range(4):
        at = out.index(f"F{i}.0")
        assert out[at + 1 : at + 3] == [f"SF{i}.0", f"LO{i}.0"]
    batch_out = names(inject_swap_steps(GPIPE_BATCH, PP2_BATCH, 0))
    for i in range(3):
        at = batch_out.index(f"F{i}.0")
        assert batch_out[at + 1 : at + 3] == [f"BATCH[SF{i}.0]", f"LO{i}.0"]
    # a container holding the slot's send and the next slot's receive only posts both
    at = batch_out.index("BATCH[SF3.0+RB0.0]")
    assert batch_out[at + 1 : at + 4] == ["LO3.0", "WL0.0", "B0.0"]


def test_launch_offload_after_composite_container() -> None:
    order = (
        fwd(0, 0),
        fwd(0, 1),
        fwd(0, 2),
        MetaStep(K.OVERLAP_B_F, 0, 0, sub_steps=(bwd(0, 9), fwd(0, 3))),
        p2p(K.SEND_F, 0, 3, 1),
        bwd(0, 0),
        bwd(0, 1),
        bwd(0, 2),
        bwd(0, 3),
    )
    order = (fwd(0, 9), *order)  # chunk 9's forward, consumed inside the composite
    cfg = ScheduleConfig(schedule="gpipe", pp=2, micro=4, swap=True, min_swap_gap=4)
    out = inject_swap_steps(order, cfg, 0)
    at = names(out).index("OBF[B9.0+F3.0]")
    assert names(out)[at + 1 : at + 3] == ["SF3.0", "LO3.0"]
    # the composite itself is untouched
    assert out[at] == order[4]


def test_wait_offload_after_first_intervening_compute_and_comm_block() -> None:
    out = names(inject_swap_steps(GPIPE_PLAIN, PP2, 0))
    # chunk 0: first intervening compute F1, its send SF1 (and chunk 1's LO1), then WO0
    # right before F2
    assert out[out.index("F2.0") - 1] == "WO0.0"
    assert out[out.index("WO0.0") - 2 : out.index("WO0.0")] == ["SF1.0", "LO1.0"]
    # chunk 3: first intervening compute B0, then B0's block (WO3 ahead of LL2 and RB1)
    at = out.index("B0.0")
    assert out[at : at + 6] == ["B0.0", "WO3.0", "LL2.0", "RB1.0", "WL1.0", "B1.0"]


def test_wait_offload_goes_ahead_of_a_launch_load_in_its_block() -> None:
    # chunk 2: after F3, the block (SF3, RB0) also receives LL1 (before B0's recv), so the
    # device storage of chunk 2 is released before chunk 1's is allocated again.
    out = names(inject_swap_steps(GPIPE_PLAIN, PP2, 0))
    at = out.index("SF3.0")
    assert out[at : at + 6] == ["SF3.0", "LO3.0", "WO2.0", "LL1.0", "RB0.0", "WL0.0"]
    batch_out = names(inject_swap_steps(GPIPE_BATCH, PP2_BATCH, 0))
    at = batch_out.index("BATCH[SF3.0+RB0.0]")
    assert batch_out[at - 2 : at] == ["WO2.0", "LL1.0"]


def test_launch_load_at_last_cover_point_before_recvs() -> None:
    out = names(inject_swap_steps(GPIPE_PLAIN, PP2, 0))
    # chunk 2 (consumer B2): before compute B1 and before B1's recv RB1
    assert out[out.index("RB1.0") - 1] == "LL2.0"
    # chunk 0 (consumer B0): before compute F3; F3 has no recv, so right before it
    assert out[out.index("F3.0") - 1] == "LL0.0"


def test_wait_load_right_before_consumer_after_its_recv() -> None:
    out = names(inject_swap_steps(GPIPE_PLAIN, PP2, 0))
    for i in range(4):
        at = out.index(f"B{i}.0")
        assert out[at - 1] == f"WL{i}.0"
        assert out.index(f"RB{i}.0") < at - 1


def test_batch_container_is_never_split() -> None:
    out = inject_swap_steps(GPIPE_BATCH, PP2_BATCH, 0)
    assert text(out) == (
        "F0.0 BATCH[SF0.0] LO0.0 F1.0 BATCH[SF1.0] LO1.0 WO0.0 F2.0 BATCH[SF2.0] LO2.0 "
        "WO1.0 LL0.0 F3.0 WO2.0 LL1.0 BATCH[SF3.0+RB0.0] LO3.0 WL0.0 B0.0 "
        "WO3.0 LL2.0 BATCH[RB1.0] WL1.0 B1.0 LL3.0 BATCH[RB2.0] WL2.0 B2.0 "
        "BATCH[RB3.0] WL3.0 B3.0"
    )
    containers = [s for s in out if s.kind is K.BATCH_SEND_RECV]
    assert containers == [s for s in GPIPE_BATCH if s.kind is K.BATCH_SEND_RECV]
    assert all(not leaf.is_swap for c in containers for leaf in c.sub_steps)


def test_p2p_steps_never_reordered() -> None:
    for order, cfg in ((GPIPE_PLAIN, PP2), (GPIPE_BATCH, PP2_BATCH)):
        out = inject_swap_steps(order, cfg, 0)
        assert strip_swap_steps(out) == order


# -- FSDP ---------------------------------------------------------------------------------

# Rank 0 of pp=2 vpp=2 (stages 0 and 2) with FSDP: stage 0 is resharded after F0.0 and
# unsharded again with a one-step lookahead (before B1.2) for the run that B0.0 starts.
FSDP_LOOKAHEAD: Order = (
    unshard(0),
    fwd(0, 0),
    reshard(0),
    unshard(2),
    fwd(2, 0),
    fwd(2, 1),
    bwd(2, 0),
    unshard(0),
    bwd(2, 1),
    reshard(2),
    bwd(0, 0),
    reshard(0),
)
VPP_FSDP = ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=2, micro=2, swap=True, fsdp=True)


def test_fsdp_lookahead_golden() -> None:
    assert text(inject_swap_steps(FSDP_LOOKAHEAD, VPP_FSDP, 0)) == (
        "UN.s0 F0.0 LO0.0 RE.s0 UN.s2 F0.2 WO0.0 F1.2 B0.2 LL0.0 UN.s0 B1.2 RE.s2 WL0.0 B0.0 RE.s0"
    )


def test_fsdp_fwd_then_launch_offload_then_reshard() -> None:
    out = names(inject_swap_steps(FSDP_LOOKAHEAD, VPP_FSDP, 0))
    assert out[:4] == ["UN.s0", "F0.0", "LO0.0", "RE.s0"]


def test_fsdp_launch_load_before_lookahead_unshard() -> None:
    out = names(inject_swap_steps(FSDP_LOOKAHEAD, VPP_FSDP, 0))
    ll, un = out.index("LL0.0"), out.index("UN.s0", 1)
    assert un == ll + 1
    assert ll < out.index("WL0.0") == out.index("B0.0") - 1


def test_fsdp_already_unsharded_delays_load_to_consumer() -> None:
    # One stage, unsharded once for the whole step: no lookahead to cover, so the H2D copy
    # is launched right before its wait, just before BWD.
    order = (unshard(0), *(fwd(0, i) for i in range(4)), *(bwd(0, i) for i in range(4)))
    order = (*order, reshard(0))
    cfg = ScheduleConfig(schedule="gpipe", pp=1, micro=4, swap=True, fsdp=True)
    assert text(inject_swap_steps(order, cfg, 0)) == (
        "UN.s0 F0.0 LO0.0 F1.0 LO1.0 WO0.0 F2.0 LO2.0 WO1.0 F3.0 LO3.0 WO2.0 LL0.0 WL0.0 "
        "B0.0 WO3.0 LL1.0 WL1.0 B1.0 LL2.0 WL2.0 B2.0 LL3.0 WL3.0 B3.0 RE.s0"
    )


def test_fsdp_unshard_before_wait_offload_clamps_launch_load() -> None:
    # gap 3 with min_swap_gap=3: the lookahead UN.s0 sits before chunk (0,0)'s WAIT_OFFLOAD,
    # so LAUNCH_LOAD cannot go before it; it follows the WAIT_OFFLOAD instead.
    order = (
        unshard(0),
        fwd(0, 0),
        reshard(0),
        unshard(2),
        fwd(2, 0),
        unshard(0),
        bwd(2, 0),
        reshard(2),
        bwd(0, 0),
        reshard(0),
    )
    cfg = ScheduleConfig(
        schedule="interleaved_1f1b", pp=2, vpp=2, micro=2, swap=True, fsdp=True, min_swap_gap=3
    )
    assert text(inject_swap_steps(order, cfg, 0)) == (
        "UN.s0 F0.0 LO0.0 RE.s0 UN.s2 F0.2 UN.s0 WO0.0 LL0.0 B0.2 RE.s2 WL0.0 B0.0 RE.s0"
    )


def test_fsdp_unshard_then_fwd_kept_in_order() -> None:
    out = inject_swap_steps(FSDP_LOOKAHEAD, VPP_FSDP, 0)
    got = names(out)
    assert got.index("UN.s2") < got.index("F0.2")
    assert strip_swap_steps(out) == FSDP_LOOKAHEAD


# -- dx/dw, and real overlap with dx/dw ----------------------------------------------------

# Rank 1 (stage 1) of a 3-rank 1F1B with overlap_b_f and split_dw: the steady-state slot is
# OVERLAP_B_F(BWD_INPUT_0, FWD_2); the dx send SB0 follows it, then BWD_WEIGHT_0.
OVERLAP_DXDW: Order = (
    p2p(K.RECV_F, 1, 0, 0),
    fwd(1, 0),
    p2p(K.SEND_F, 1, 0, 2),
    p2p(K.RECV_F, 1, 1, 0),
    fwd(1, 1),
    p2p(K.SEND_F, 1, 1, 2),
    p2p(K.RECV_B, 1, 0, 2),
    p2p(K.RECV_F, 1, 2, 0),
    MetaStep(K.OVERLAP_B_F, 1, 0, sub_steps=(MetaStep(K.BWD_INPUT, 1, 0), fwd(1, 2))),
    p2p(K.SEND_B, 1, 0, 0),
    MetaStep(K.BWD_WEIGHT, 1, 0),
    p2p(K.SEND_F, 1, 2, 2),
    p2p(K.RECV_B, 1, 1, 2),
    MetaStep(K.BWD_INPUT, 1, 1),
    p2p(K.SEND_B, 1, 1, 0),
    MetaStep(K.BWD_WEIGHT, 1, 1),
    p2p(K.RECV_B, 1, 2, 2),
    MetaStep(K.BWD_INPUT, 1, 2),
    p2p(K.SEND_B, 1, 2, 0),
    MetaStep(K.BWD_WEIGHT, 1, 2),
)
PP3_OVERLAP = ScheduleConfig(
    schedule="1f1b", pp=3, micro=3, split_dw=True, overlap_b_f=True, swap=True, min_swap_gap=2
)


def test_overlap_dxdw_sequence_of_rfc_6_8_4() -> None:
    out = names(inject_swap_steps(OVERLAP_DXDW, PP3_OVERLAP, 1))
    obf = out.index("OBF[I0.1+F2.1]")
    # LAUNCH_LOAD(i) -> WAIT_LOAD(i) -> OVERLAP_B_F(BWD_INPUT_i, FWD_j) -> SEND_B_i -> W_i
    assert out[obf - 2 : obf] == ["LL0.1", "WL0.1"]
    assert obf < out.index("SB0.1") < out.index("W0.1")
    # the composite's FWD_j starts its own offload right after the composite's sends
    assert out[obf + 1 : obf + 3] == ["SB0.1", "LO2.1"]
    # no swap step is ever attached to BWD_WEIGHT
    for i in range(3):
        assert not out[out.index(f"W{i}.1") - 1].startswith("WL")


def test_overlap_dxdw_golden() -> None:
    # chunk 0: gap 2 (clamped: WO, LL, WL before the composite); chunk 1: gap 3;
    # chunk 2: FWD inside the composite (slot 2), consumer I2 (slot 6): gap 4.
    assert text(inject_swap_steps(OVERLAP_DXDW, PP3_OVERLAP, 1)) == (
        "RF0.1 F0.1 SF0.1 LO0.1 RF1.1 F1.1 SF1.1 LO1.1 RB0.1 RF2.1 WO0.1 LL0.1 WL0.1 "
        "OBF[I0.1+F2.1] SB0.1 LO2.1 WO1.1 LL1.1 W0.1 SF2.1 RB1.1 WO2.1 WL1.1 I1.1 SB1.1 "
        "LL2.1 W1.1 RB2.1 WL2.1 I2.1 SB2.1 W2.1"
    )


def test_stage_zero_keeps_unified_bwd_as_consumer() -> None:
    order = (*(fwd(0, i) for i in range(4)), *(bwd(0, i) for i in range(4)))
    cfg = ScheduleConfig(schedule="gpipe", pp=2, micro=4, swap=True, split_dw=True)
    out = names(inject_swap_steps(order, cfg, 0))
    assert all(out[out.index(f"B{i}.0") - 1] == f"WL{i}.0" for i in range(4))


def test_chunks_on_host_peak_counts_offloads_not_yet_loaded_in_launch_order() -> None:
    # One copy thread: LO0 LO1 LO2 (3 on host) LL0 LO3 (3 again) LL1 LL2 LL3
    one_thread = {"split_directions": False}
    assert chunks_on_host_peak(inject_swap_steps(GPIPE_PLAIN, PP2, 0), **one_thread) == 3
    assert chunks_on_host_peak(GPIPE_PLAIN, **one_thread) == 0
    # chunks 0 and 2 only: LO2 is launched before LL0, so both are on host at once
    two = inject_swap_steps(GPIPE_PLAIN, PP2, 0, chunks={(0, 0), (0, 2)})
    assert chunks_on_host_peak(two, **one_thread) == 2
    one = inject_swap_steps(GPIPE_PLAIN, PP2, 0, chunks={(0, 1)})
    assert chunks_on_host_peak(one, **one_thread) == 1
    # A thread per direction: LL0 may still run when LO3 does; WL0 comes after it (4)
    assert chunks_on_host_peak(inject_swap_steps(GPIPE_PLAIN, PP2, 0)) == 4
    assert chunks_on_host_peak(two) == 2
