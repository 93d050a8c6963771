"""Measured peaks of saved activation bytes on torch stages, against the planner's model.

Both sides are measured from live storages (``RankStats.peak_saved_bytes``); the planner
(``memory_table``) only contributes chunk counts. See tests/runtime/test_runtime_memory.py
for the MindSpore version of the exact check.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from cyclic_garbage import collector_off, ppswap_cyclic_garbage, swap_tracked_per_storage
from torch import nn
from torch_support import (
    Case,
    build_flat_stages,
    build_modules,
    build_stages,
    make_data,
    make_flat_data,
    mse_loss,
    predictions,
    run_case,
    sharded_stages,
)

from ppswap import run_schedule
from ppswap.backends.torch import BACKEND as TORCH
from ppswap.fsdp import DeviceMesh, fsdp_state_of, fully_shard
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.simulate import memory_table
from ppswap.swap.manager import current_collection

PP, MICRO = 4, 8


@pytest.mark.asyncio
async def test_gpipe_peak_matches_the_plan_exactly_and_at_least_halves() -> None:
    """GPipe pp4 m8 on MLP stages whose saved activations each own their storage: with
    swap the peak holds ``peak_chunks_swap`` chunks' movable bytes plus, for every chunk
    alive at the peak, the bytes that stay on device (stage inputs, the loss's), to the
    byte; and it is at most half the peak without swap."""
    x, y = make_flat_data(2 * MICRO)
    runs = {}
    for swap in (False, True):
        runs[swap] = await run_schedule(
            build_flat_stages(PP),
            "gpipe",
            micro_batch_num=MICRO,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            swap=swap,
        )
    assert runs[True].losses == runs[False].losses
    plan = memory_table(ScheduleConfig(schedule="gpipe", pp=PP, micro=MICRO, swap=True))
    for rank in range(PP):
        off, on, predicted = runs[False].ranks[rank], runs[True].ranks[rank], plan[rank]
        assert predicted["eligible"] == MICRO  # GPipe: every chunk's gap is >= 4
        chunk_bytes = off.peak_saved_bytes / predicted["peak_chunks_no_swap"]
        movable = on.offloaded_bytes / predicted["eligible"]
        pinned = chunk_bytes - movable
        assert movable > 0 and pinned > 0  # the stage input always stays
        expected = (
            predicted["peak_chunks_swap"] * movable + predicted["peak_chunks_no_swap"] * pinned
        )
        assert on.peak_saved_bytes == pytest.approx(expected, abs=1)
        assert on.peak_saved_bytes <= off.peak_saved_bytes / 2
        assert on.loaded_bytes == on.offloaded_bytes


@pytest.mark.asyncio
async def test_swap_never_raises_the_peak_where_the_plan_predicts_no_cut() -> None:
    """1F1B pp4 m8 on the attention + MLP stages: rank 1 swaps chunks although its planned
    peak stays at 3 chunks; the measured peak with swap is then no higher than without.
    It holds because the views of one storage (tanh's output saved as (b, s, h) by tanh
    and as (b*s, h) by the next linear) move as one span and come back as views of one
    block, not as an allocation each (docs/swap.md, storage spans)."""
    case = Case("1f1b", pp=PP, stage_num=PP, micro=MICRO)
    plan = predictions(case.config())
    checked = [p.rank for p in plan if p.eligible and not p.cuts_peak]
    assert checked == [1]
    off = await run_case(build_stages(PP), case, swap=False)
    on = await run_case(build_stages(PP), case, swap=True)
    for rank in checked:
        assert on.ranks[rank].offloaded_bytes > 0
        assert on.ranks[rank].peak_saved_bytes <= off.ranks[rank].peak_saved_bytes


def test_fsdp_reshard_frees_the_full_weights_a_recorded_forward_saved() -> None:
    """A recorded forward keeps views of the unsharded weights (``nn.Linear`` saves
    ``weight.t()``). After the reshard those views' storage holds 0 bytes: the full
    parameters are really freed while the backward waits. The next unshard refills it,
    and the backward then equals the unsharded model's bit for bit."""
    mesh = DeviceMesh(pp=1, dp=2)
    replicas = [build_modules(1, wrap=False)[0] for _ in range(mesh.dp)]
    for dp_rank, module in enumerate(replicas):
        fully_shard(module, mesh=mesh, dp_rank=dp_rank)
    states = [fsdp_state_of(m) for m in replicas]

    def unshard() -> None:
        gathered = [state.snapshot_shard() for state in states if state is not None]
        for state in states:
            assert state is not None
            state.install_full(gathered)

    def reshard() -> None:
        for state in states:
            assert state is not None
            state.reshard()

    x, y = (torch.from_numpy(a) for a in make_data())
    module = replicas[0]
    unshard()
    full_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = mse_loss(module(x), y)
    weight_views = [
        t
        for t in saved
        if not isinstance(t, nn.Parameter) and t.untyped_storage().data_ptr() in full_ptrs
    ]
    assert len(weight_views) == 4  # qkv, proj, fc1, fc2: weight.t()
    full_bytes = [t.untyped_storage().nbytes() for t in weight_views]
    assert all(n == t.numel() * 4 for n, t in zip(full_bytes, weight_views, strict=True))
    reshard()
    assert [t.untyped_storage().nbytes() for t in weight_views] == [0, 0, 0, 0]
    unshard()
    assert [t.untyped_storage().nbytes() for t in weight_views] == full_bytes
    grads = torch.autograd.grad(loss, list(module.parameters()))
    reshard()

    (reference,) = build_modules(1, wrap=False)
    expected = torch.autograd.grad(mse_loss(reference(x), y), list(reference.parameters()))
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))


class _CollectionProbe(nn.Module):
    """Records, at each forward, whether a swap collection (and so its saved-tensor
    hooks) is active."""

    def __init__(self, seen: list[bool]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(current_collection() is not None)
        return x


@pytest.mark.asyncio
async def test_a_run_without_counting_has_no_hooks_and_the_same_results() -> None:
    """``count_saved_bytes=False`` (without swap): no collection around any forward, so
    no saved-tensor hooks; losses and gradients bit-identical to the counting run, and
    ``peak_saved_bytes`` 0 where the counting run measured bytes."""
    x, y = make_flat_data(2 * MICRO)
    seen: dict[bool, list[bool]] = {True: [], False: []}
    runs, grads = {}, {}
    for count in (True, False):
        stages = build_flat_stages(PP)
        stages[0].module.insert(0, _CollectionProbe(seen[count]))
        runs[count] = await run_schedule(
            stages,
            "gpipe",
            micro_batch_num=MICRO,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            count_saved_bytes=count,
        )
        grads[count] = [g.clone() for stage in stages for g in stage.grads]
    assert seen[True] == [True] * MICRO and seen[False] == [False] * MICRO
    assert runs[False].losses == runs[True].losses
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))
    assert all(rank.peak_saved_bytes > 0 for rank in runs[True].ranks)
    assert all(rank.peak_saved_bytes == 0 for rank in runs[False].ranks)


@pytest.mark.asyncio
async def test_storages_under_swap_min_bytes_stay_on_device_and_still_count() -> None:
    """GPipe pp2 m4 on the flat MLP stages (micro-batches of 16 rows: 1 KiB storages of
    width 16, 2 KiB ones of the hidden width 32): ``swap_min_bytes=2048`` keeps the 1 KiB
    ones on device and moves the rest, one byte more keeps every one on device, so
    nothing moves and the peak is the peak without swap, to the byte. Losses and
    gradients are bit-identical in every run."""
    x, y = make_flat_data(4 * 16)
    runs = {}
    for name, options in (
        ("off", {"swap": False}),
        ("default", {"swap": True}),
        ("hidden only", {"swap": True, "swap_min_bytes": 16 * 32 * 4}),
        ("above", {"swap": True, "swap_min_bytes": 16 * 32 * 4 + 1}),
    ):
        stages = build_flat_stages(2)
        result = await run_schedule(
            stages, "gpipe", micro_batch_num=4, inputs=x, targets=y, loss_fn=mse_loss, **options
        )
        runs[name] = (result, [[g.clone() for g in s.grads] for s in stages])
    off, off_grads = runs["off"]
    for name, (result, grads) in runs.items():
        assert result.losses == off.losses, name
        for got, want in zip(grads, off_grads, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name
    moved = [r.offloaded_bytes for r in runs["default"][0].ranks]
    assert all(m > 0 for m in moved)
    hidden_only = [r.offloaded_bytes for r in runs["hidden only"][0].ranks]
    assert all(0 < h < m for h, m in zip(hidden_only, moved, strict=True))
    above = runs["above"][0]
    assert [r.offloaded_bytes for r in above.ranks] == [0, 0]
    assert [r.loaded_bytes for r in above.ranks] == [0, 0]
    assert [r.peak_saved_bytes for r in above.ranks] == [r.peak_saved_bytes for r in off.ranks]


@pytest.mark.asyncio
async def test_the_peak_policy_measures_the_gap_rules_peak_with_fewer_bytes_moved() -> None:
    """``swap_policy="peak"`` on GPipe pp4 m8 (flat stages) and 1F1B pp4 m8 (attention +
    MLP): every rank's measured peak of saved bytes is the gap rule's to the byte, with
    fewer bytes moved, and 1F1B's rank 1, whose peak no swap lowers, moves none."""
    x, y = make_flat_data(2 * MICRO)
    flat = {"micro_batch_num": MICRO, "inputs": x, "targets": y, "loss_fn": mse_loss}
    gpipe = {
        policy: await run_schedule(
            build_flat_stages(PP), "gpipe", swap=True, swap_policy=policy, **flat
        )
        for policy in ("gap", "peak")
    }
    case = Case("1f1b", pp=PP, stage_num=PP, micro=MICRO)
    one_f_one_b = {
        policy: await run_case(build_stages(PP), case, swap=True, swap_policy=policy)
        for policy in ("gap", "peak")
    }
    for runs in (gpipe, one_f_one_b):
        gap, peak = runs["gap"], runs["peak"]
        assert peak.losses == gap.losses
        assert [r.peak_saved_bytes for r in peak.ranks] == [r.peak_saved_bytes for r in gap.ranks]
        assert sum(r.offloaded_bytes for r in peak.ranks) < sum(
            r.offloaded_bytes for r in gap.ranks
        )
    assert one_f_one_b["gap"].ranks[1].offloaded_bytes > 0
    assert one_f_one_b["peak"].ranks[1].offloaded_bytes == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "case",
    [
        Case("gpipe", pp=4, stage_num=4, micro=8),
        Case("interleaved_1f1b", pp=2, stage_num=4, micro=8, split_dw=True),
        Case("1f1b", pp=4, stage_num=4, micro=8, overlap_b_f=True, p2p="batch"),
    ],
    ids=["gpipe", "interleaved-split-dw", "1f1b-overlap-batch"],
)
async def test_a_finished_run_leaves_nothing_of_ppswap_to_the_garbage_collector(
    case: Case,
) -> None:
    """With the collector off, stages built, run with and without swap, and dropped leave
    no ppswap object in a reference cycle: the run's actors, swap groups, entries and chunk
    records are freed by reference counting when it ends, and the stages (with the
    parameters and gradients they hold) when the caller drops them. A cycle would keep
    them, and what they hold, until some later collection."""
    with collector_off():
        stages = build_stages(case.stage_num)
        for swap in (False, True):
            result = await run_case(stages, case, swap=swap)
            assert sum(r.offloaded_bytes for r in result.ranks) > 0 or not swap
        del stages, result
        assert ppswap_cyclic_garbage() == Counter()


@pytest.mark.asyncio
async def test_an_fsdp_run_leaves_nothing_of_ppswap_to_the_garbage_collector() -> None:
    """The same for dp2 x pp2 with every replica's stage ``fully_shard()``-ed: the FSDP
    steps' state goes with the run, the sharded stages with the caller's reference."""
    case = Case("gpipe", pp=2, stage_num=2, micro=4)
    x, y = make_data(2 * case.micro)
    with collector_off():
        stages = sharded_stages(case.stage_num, DeviceMesh(pp=case.pp, dp=2))
        for swap in (False, True):
            result = await run_case(stages, case, swap=swap, inputs=x, targets=y)
            assert sum(r.offloaded_bytes for r in result.ranks) > 0 or not swap
        del stages, result
        assert ppswap_cyclic_garbage() == Counter()


# Measured 20.4-20.5 on torch 2.11 and 2.13 (a stage of two swap-wrapped blocks, 8
# storages moved; the group's and the hooks' own objects are spread over them). A layout
# with a record per field of a view (entry, storage record, fingerprint, block record,
# span lists) measured 34.
TRACKED_PER_STORAGE = 22


def test_a_swapped_chunk_keeps_few_objects_for_the_collector_until_its_backward() -> None:
    """Every object a swapped chunk keeps from its forward to its backward outlives the
    young collections, so the full collections (which walk the whole process: 100-140 ms
    with torch loaded) come sooner the more there are. Beyond what the same chunk keeps
    without swap, swap may keep at most ``TRACKED_PER_STORAGE`` tracked objects per
    storage it moves: the view's entry, its span, its key, the hook's record and the
    restored tensor, not a record per field."""
    x = torch.from_numpy(make_data()[0][:4].copy())
    tracked = swap_tracked_per_storage(TORCH, lambda: build_modules(1)[0], x)
    assert tracked <= TRACKED_PER_STORAGE
