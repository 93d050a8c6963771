"""Run under ``torchrun --nproc_per_node N``: torch pipelines over TorchDistTransport.

    pipeline.py [--perturb CASE=swap|unsplit ...] CASE [CASE ...]

A case is ``SCHEDULE-P2P[-dw][-overlap][-big][-bf16][-dropout][-tuple][-autocast]``: SCHEDULE
``gpipe``, ``1f1b``, ``interleaved`` (vpp 2), ``looped_bfs``, ``interleaved_zb``, ``zbv``
or ``dualpipev`` (vpp 2; the last two place stages ``r`` and ``2N - 1 - r`` on rank ``r``),
or ``vorder``: a compute order written here in torch's action notation and given as
``order=`` (V placement; per rank the first leg's forwards, the second leg's forwards and
full backwards, then the first leg's backwards split into BWD_INPUT and deferred
BWD_WEIGHT), P2P ``plain``, ``batch`` or ``boundary``,
``-dw`` for ``split_dw``, ``-overlap`` for ``overlap_b_f``. The run has pp = N ranks,
N * vpp stages and 2 * N micro-batches of 2 samples (``-big``: 160 samples, so every
activation and gradient between ranks is 20 KiB, above the 16 KiB inline limit this script
gives its transport (``INLINE_MAX_BYTES``), and travels as a header and a body),
``min_swap_gap=2`` (so 1F1B at pp 2 swaps too). ``-bf16``: the model and the batch in
bfloat16 (activations and gradients cross the process boundary as ``ml_dtypes``'
bfloat16). ``-dropout``: each stage ends with dropout (p 0.2), torch seeded alike before
every run: the masks come from each stage's own stream (``ppswap/backends/torch/rng.py``),
so they are the same in every process layout; such a case is not compared with the
unsplit model (check 2). ``-tuple``: the stages pass ``(hidden, mask, scale)`` along
(``TupleStage``: an int64 mask, no gradient travels back for it, and a float scale every
stage uses and changes), so activations and gradients cross the process boundary packed
(``ppswap.core.packed``); it does not combine with ``-dropout``. ``-autocast``: float32
weights and batch, every ``run_schedule`` call under ``torch.autocast`` to bfloat16 (each
process's own, carried to its compute thread: ``ppswap/backends/torch/caller.py``); it
does not combine with ``-bf16``.

Every process builds all stages from one seed (the attention + MLP stage model of
``tests/torch_backend/torch_support.py``, both blocks swap-wrapped), keeps its own (the
stages the schedule places on its rank) and runs each case twice over one transport, swap
off then on. Per case and rank it checks:

1. swap on is bit-identical to swap off: the losses and this rank's gradients, byte for
   byte;
2. both equal one unsplit torch model computed here (the same seed, every stage chained
   in one process, the whole batch): each micro-batch's loss and this rank's
   gradients of the mean loss, rtol 1e-5 (atol 1e-6). In bfloat16 the unsplit model
   computes in float32 on the same bfloat16 weights and batch, losses within rtol 1e-2
   and each gradient within 3% of its largest element (measured on the 2-sample
   micro-batches at 2 and 4 ranks: at most 1.2%; a micro-batch's contribution missing or
   counted twice is off by 25% or more). A bfloat16 model is no reference: torch's CPU
   kernels reduce in bfloat16 (one thread: 9.5% off a float32 reduction on the ``-big``
   batch, measured), so the bfloat16 cases keep the small batch. Under ``-autocast`` the
   unsplit model runs micro-batch by micro-batch, each forward under the same autocast
   entered anew (as a pipeline forward, or a training loop's step, enters it: one
   autocast around every micro-batch would cast each weight once, and its gradient would
   then add up in bfloat16), rtol 1e-5;
3. swap moved bytes on exactly the ranks where the plan swaps a chunk, and loaded all of
   them back (from every rank's stats, which every process gets back);
4. on rank 0 only: every rank's swap-on gradients (all-gathered over the transport) and
   the losses are bit-identical to the same pipeline run in this process
   (``InProcessTransport``, all stages, swap on).

It prints ``rank R case NAME OK ...`` per passed case and ``rank R case NAME MISMATCH:
...`` per failed check; after the last case every rank exits 1 if any rank found a
mismatch. ``--perturb CASE=swap`` adds one ulp to a gradient of the swap-on run on the
last rank (checks 1 and 4 must fail); ``--perturb CASE=unsplit`` scales a gradient of
both runs on the last rank by 1 + 1e-3 (check 1 passes, 2 and 4 must fail): the test's
proof that the checks can fail. An exception ends the job through the runtime's abort
(every process exits non-zero).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import anyio
import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from ppswap import PipelineStage, RankStats, run_schedule
from ppswap.backends.torch.distributed import TorchDistTransport
from ppswap.core.wire import INLINE_MAX_BYTES
from ppswap.scheduler.config import P2PMode, ScheduleConfig, ScheduleName
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.swap_plan import eligible_chunks
from ppswap.scheduler.user_orders import check_orders_given, read_orders

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch_backend"))
from torch_support import build_modules, make_data, mse_loss

Array = npt.NDArray[Any]
RTOL, ATOL = 1e-5, 1e-6
MIN_SWAP_GAP = 2
SCHEDULES: dict[str, ScheduleName] = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved": "interleaved_1f1b",
    "looped_bfs": "looped_bfs",
    "interleaved_zb": "interleaved_zb",
    "zbv": "zbv",
    "dualpipev": "dualpipev",
    "vorder": "gpipe",  # only a label: the case's order replaces the schedule's
}
TWO_STAGES_PER_RANK = frozenset({"interleaved", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"})
BF16_LOSS_RTOL = 1e-2
BF16_GRAD_TOLERANCE = 0.03  # of a gradient's largest magnitude (module docstring)
CASE_NAME = re.compile(
    r"(gpipe|1f1b|interleaved_zb|interleaved|looped_bfs|zbv|dualpipev|vorder)"
    r"-(plain|batch|boundary)(-dw)?(-overlap)?(-big)?(-bf16)?"
    r"(-dropout)?(-tuple)?(-autocast)?"
)
DROPOUT_SEED = 1234


@dataclass(frozen=True)
class Case:
    name: str
    schedule: ScheduleName
    p2p: P2PMode
    split_dw: bool
    overlap_b_f: bool
    samples: int  # per micro-batch
    dtype: torch.dtype
    dropout: bool = False
    tupled: bool = False
    autocast: bool = False
    vpp: int = 1
    given_order: bool = False

    @classmethod
    def parse(cls, name: str) -> Case:
        match = CASE_NAME.fullmatch(name)
        if match is None:
            raise SystemExit(
                f"bad case {name!r}: expected "
                "SCHEDULE-P2P[-dw][-overlap][-big][-bf16][-dropout][-tuple][-autocast]"
            )
        schedule, p2p, dw, overlap, big, bf16, dropout, tupled, autocast = match.groups()
        if dropout and tupled:
            raise SystemExit(f"bad case {name!r}: -dropout and -tuple do not combine")
        if bf16 and autocast:
            raise SystemExit(f"bad case {name!r}: -bf16 and -autocast do not combine")
        mode = cast(P2PMode, p2p)
        samples = 160 if big else 2
        dtype = torch.bfloat16 if bf16 else torch.float32
        return cls(
            name,
            SCHEDULES[schedule],
            mode,
            dw is not None,
            overlap is not None,
            samples,
            dtype,
            dropout is not None,
            tupled is not None,
            autocast is not None,
            2 if schedule in TWO_STAGES_PER_RANK or schedule == "vorder" else 1,
            schedule == "vorder",
        )

    def data(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch of ``micro`` micro-batches, inputs and targets, in the case's
        dtype."""
        x, y = make_data(self.samples * micro)
        return torch.from_numpy(x).to(self.dtype), torch.from_numpy(y).to(self.dtype)

    def modules(self, stage_num: int, *, wrap: bool = True) -> list[nn.Module]:
        modules = [m.to(self.dtype) for m in build_modules(stage_num, wrap=wrap)]
        if self.dropout:
            return [nn.Sequential(m, nn.Dropout(0.2)) for m in modules]
        if self.tupled:
            return [TupleStage(m, i, stage_num) for i, m in enumerate(modules)]
        return modules

    def mixed(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast of an ``-autocast`` case's runs and reference (else nothing)."""
        if self.autocast:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sizes(self, world: int) -> tuple[int, int, int]:
        """(vpp, stage_num, micro) for a run of ``world`` ranks."""
        return self.vpp, world * self.vpp, 2 * world

    def order_rows(self, world: int) -> list[list[str]] | None:
        """A ``vorder`` case's compute orders, one row of torch's notation per rank (see
        the module docstring); None for the other cases."""
        if not self.given_order:
            return None
        _, stage_num, micro = self.sizes(world)
        rows = []
        for rank in range(world):
            first, second = rank, stage_num - 1 - rank
            row = [f"{first}F{i}" for i in range(micro)] + [f"{second}F{i}" for i in range(micro)]
            row += [f"{second}B{i}" for i in range(micro)] + [f"{first}I{i}" for i in range(micro)]
            rows.append(row + [f"{first}W{i}" for i in range(micro)])
        return rows

    def config(self, world: int) -> ScheduleConfig:
        """The case's schedule on ``world`` ranks, with swap (its placement, its plan)."""
        vpp, stage_num, micro = self.sizes(world)
        rows = self.order_rows(world)
        return ScheduleConfig(
            schedule=self.schedule,
            pp=world,
            vpp=vpp,
            micro=micro,
            split_dw=self.split_dw,
            overlap_b_f=self.overlap_b_f,
            p2p=self.p2p,
            swap=True,
            min_swap_gap=MIN_SWAP_GAP,
            order=None if rows is None else check_orders_given(read_orders(rows), stage_num, micro),
        )


class TupleStage(nn.Module):
    """A stage passing ``(hidden, mask, scale)`` on (the first takes the batch, the last
    returns one tensor); see the module docstring."""

    def __init__(self, inner: nn.Module, index: int, stage_num: int) -> None:
        super().__init__()
        self.inner, self.first, self.last = inner, index == 0, index == stage_num - 1

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.first:
            (x,) = args
            hidden = self.inner(x)
            mask = (x[..., :1] > -0.5).long()
            return hidden, mask, torch.sigmoid(hidden.mean(-1, keepdim=True))
        hidden, mask, scale = args
        if self.last:
            out: torch.Tensor = self.inner(hidden) * mask + scale
            return out
        hidden = self.inner(hidden) * scale * mask
        return hidden, mask, scale * torch.tanh(hidden.mean(-1, keepdim=True))


def chain(modules: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The stages one after the other, a tuple passed on as the next one's arguments."""
    out: Any = x
    for module in modules:
        out = module(*out) if isinstance(out, tuple) else module(out)
    return cast(torch.Tensor, out)


@dataclass
class Outcome:
    losses: list[float]
    grads: dict[int, list[Array]]  # this rank's stages: stage index -> gradients
    ranks: list[RankStats]


async def run(
    case: Case, world: int, *, swap: bool, transport: TorchDistTransport | None
) -> Outcome:
    """The case over ``transport`` (this rank's stages), or in this process (None: every
    stage, ``pp=world``)."""
    _, stage_num, micro = case.sizes(world)
    config = case.config(world)
    stages = [
        PipelineStage(m, i, stage_num)
        for i, m in enumerate(case.modules(stage_num))
        if transport is None or config.rank_of(i) == transport.rank
    ]
    rows = case.order_rows(world)
    given = {} if rows is None else {"order": rows}
    if case.dropout:
        torch.manual_seed(DROPOUT_SEED)
    x, y = case.data(micro)
    with case.mixed():
        result = await run_schedule(
            stages,
            case.schedule,
            micro_batch_num=micro,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            swap=swap,
            split_dw=case.split_dw,
            overlap_b_f=case.overlap_b_f,
            p2p=case.p2p,
            min_swap_gap=MIN_SWAP_GAP,
            pp=world,
            transport=transport,
            step_timeout=60.0,
            **given,
        )
    grads = {s.stage_index: [host_copy(g) for g in s.grads] for s in stages}
    return Outcome(list(result.losses), grads, list(result.ranks))


def host_copy(tensor: torch.Tensor) -> Array:
    """A float32 numpy copy of ``tensor`` (bfloat16 converts exactly)."""
    return tensor.detach().float().numpy().copy()


def unsplit(case: Case, world: int) -> tuple[list[float], list[list[Array]]]:
    """One torch model of every stage on the whole batch, in float32 (a bfloat16 case's
    weights and batch rounded to bfloat16 first; an ``-autocast`` case's micro-batch by
    micro-batch under its autocast): each micro-batch's loss, and the gradients of their
    mean per stage."""
    _, stage_num, micro = case.sizes(world)
    modules = [m.float() for m in case.modules(stage_num, wrap=False)]
    x, target = (t.float() for t in case.data(micro))
    if case.autocast:  # entered per micro-batch, as a training loop would (module docstring)
        losses = []
        for xm, t in zip(x.chunk(micro), target.chunk(micro), strict=True):
            with case.mixed():
                losses.append(mse_loss(chain(modules, xm), t))
    else:
        out = chain(modules, x)
        losses = [
            mse_loss(o, t) for o, t in zip(out.chunk(micro), target.chunk(micro), strict=True)
        ]
    params = [[p for p in m.parameters() if p.requires_grad] for m in modules]
    flat = torch.autograd.grad(torch.stack(losses).mean(), [p for ps in params for p in ps])
    grads: list[list[Array]] = []
    start = 0
    for ps in params:
        grads.append([host_copy(g) for g in flat[start : start + len(ps)]])
        start += len(ps)
    return [float(loss.detach()) for loss in losses], grads


def flat_grads(grads: dict[int, list[Array]], config: ScheduleConfig, rank: int) -> Array:
    """The gradients of ``rank``'s stages, in stage order, as one byte string."""
    parts = [
        g.reshape(-1).view(np.uint8)
        for i in sorted(grads)
        if config.rank_of(i) == rank
        for g in grads[i]
    ]
    return np.concatenate(parts)


async def in_process_differences(
    case: Case, transport: TorchDistTransport, on: Outcome
) -> list[str]:
    """Check 4: rank 0 gets every rank's gradient bytes and compares them, and the
    losses, with the case run in this process."""
    rank, world = transport.rank, transport.world_size
    config = case.config(world)
    mine = flat_grads(on.grads, config, rank)
    gathered = await transport.all_gather(rank, tuple(range(world)), f"grads {case.name}", mine)
    if rank != 0:
        return []
    local = await run(case, world, swap=True, transport=None)
    found = []
    if np.array(local.losses).tobytes() != np.array(on.losses).tobytes():
        found.append(f"losses {on.losses} != in-process {local.losses}")
    for r, got in enumerate(gathered):
        if got.tobytes() != flat_grads(local.grads, config, r).tobytes():
            found.append(f"rank {r}'s gradients are not bit-identical to the in-process run")
    return found


def say(line: str) -> None:
    """One line to stdout in one write: every rank writes to the same pipe, and print's
    separate write of the newline let another rank's line land in the middle."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def digest(outcome: Outcome) -> str:
    h = hashlib.sha256(np.array(outcome.losses, dtype=np.float64).tobytes())
    for index in sorted(outcome.grads):
        for g in outcome.grads[index]:
            h.update(g.tobytes())
    return h.hexdigest()[:16]


def perturb(outcome: Outcome, kind: str) -> None:
    """Change the first element of the first gradient of this rank's first stage."""
    first = outcome.grads[min(outcome.grads)][0].reshape(-1)
    if kind == "swap":
        first[0] = np.nextafter(first[0], np.float32(np.inf))
    else:
        first[0] *= np.float32(1 + 1e-3)


def bit_differences(off: Outcome, on: Outcome) -> list[str]:
    found = []
    if np.array(on.losses).tobytes() != np.array(off.losses).tobytes():
        found.append(f"losses {on.losses} != {off.losses}")
    for index, grads in off.grads.items():
        for k, (g_off, g_on) in enumerate(zip(grads, on.grads[index], strict=True)):
            if g_off.dtype != g_on.dtype or g_off.tobytes() != g_on.tobytes():
                delta = np.abs(g_on.astype(np.float64) - g_off).max()
                found.append(f"stage {index} grad {k} not bit-identical (max |d| {delta:.3g})")
    return found


def unsplit_differences(
    case: Case, outcome: Outcome, ref_losses: list[float], ref_grads: list[list[Array]]
) -> list[str]:
    found = []
    rtol = BF16_LOSS_RTOL if case.dtype is torch.bfloat16 else RTOL
    if not np.allclose(outcome.losses, ref_losses, rtol=rtol, atol=0):
        found.append(f"losses {outcome.losses} != unsplit {ref_losses}")
    for index, grads in outcome.grads.items():
        for k, (g, g_ref) in enumerate(zip(grads, ref_grads[index], strict=True)):
            if g.shape != g_ref.shape or not close(case, g, g_ref):
                found.append(
                    f"stage {index} grad {k} differs from the unsplit model "
                    f"(max |d| {np.abs(g - g_ref).max():.3g}, largest |ref| "
                    f"{np.abs(g_ref).max():.3g})"
                )
    return found


def close(case: Case, grad: Array, ref: Array) -> bool:
    if case.dtype is torch.bfloat16:
        return bool(np.abs(grad - ref).max() <= BF16_GRAD_TOLERANCE * np.abs(ref).max())
    return bool(np.allclose(grad, ref, rtol=RTOL, atol=ATOL))


def swap_differences(case: Case, world: int, off: Outcome, on: Outcome) -> list[str]:
    """Bytes moved on exactly the ranks whose plan swaps a chunk, all loaded back."""
    plan = [bool(eligible_chunks(order)) for order in build_all_orders(case.config(world))]
    found = []
    if not any(plan):
        found.append("the plan swaps nothing: the case does not exercise swap")
    for r, (swaps, s_off, s_on) in enumerate(zip(plan, off.ranks, on.ranks, strict=True)):
        if s_off.offloaded_bytes or s_off.loaded_bytes:
            found.append(f"rank {r} moved bytes with swap off")
        if (s_on.offloaded_bytes > 0) != swaps or s_on.loaded_bytes != s_on.offloaded_bytes:
            found.append(
                f"rank {r}: offloaded {s_on.offloaded_bytes}, loaded {s_on.loaded_bytes} "
                f"bytes; the plan swaps {'some' if swaps else 'no'} chunk"
            )
    return found


async def main(transport: TorchDistTransport, cases: list[Case], perturbed: dict[str, str]) -> int:
    rank, world = transport.rank, transport.world_size
    failed = np.zeros(len(cases), dtype=np.bool_)
    for index, case in enumerate(cases):
        off = await run(case, world, swap=False, transport=transport)
        on = await run(case, world, swap=True, transport=transport)
        kind = perturbed.get(case.name)
        if kind is not None and rank == world - 1:
            perturb(on, kind)
            if kind == "unsplit":
                perturb(off, kind)
        found = [f"swap on != swap off: {d}" for d in bit_differences(off, on)]
        if not case.dropout:  # the masks are the stages' streams: no unsplit model has them
            ref_losses, ref_grads = unsplit(case, world)
            found += [
                f"swap off: {d}" for d in unsplit_differences(case, off, ref_losses, ref_grads)
            ]
            found += [f"swap on: {d}" for d in unsplit_differences(case, on, ref_losses, ref_grads)]
        found += swap_differences(case, world, off, on)
        found += [
            f"distributed != in-process: {d}"
            for d in await in_process_differences(case, transport, on)
        ]
        for message in found:
            say(f"rank {rank} case {case.name} MISMATCH: {message}")
        failed[index] = bool(found)
        if not found:
            moved = on.ranks[rank].offloaded_bytes
            say(f"rank {rank} case {case.name} OK offloaded={moved} digest={digest(on)}")
    # Every rank has printed its lines before any exits (torchrun ends the others at the
    # first non-zero exit); each returns the number of cases that failed on any rank.
    everyone = await transport.all_gather(rank, tuple(range(world)), "failed", failed)
    return int(np.logical_or.reduce(everyone).sum())


def parse() -> tuple[list[Case], dict[str, str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--perturb", action="append", default=[], metavar="CASE=KIND")
    args = parser.parse_args()
    perturbed = dict(item.split("=", 1) for item in args.perturb)
    if not set(perturbed.values()) <= {"swap", "unsplit"}:
        raise SystemExit(f"--perturb CASE=swap|unsplit, got {args.perturb}")
    return [Case.parse(name) for name in args.cases], perturbed


if __name__ == "__main__":
    chosen, perturbations = parse()
    with TorchDistTransport(timeout_s=120, inline_max_bytes=INLINE_MAX_BYTES) as torch_transport:
        try:
            failed = anyio.run(main, torch_transport, chosen, perturbations)
        except BaseException:
            print(f"rank {torch_transport.rank} FAILED", file=sys.stderr, flush=True)
            traceback.print_exc()
            torch_transport.abort(1)
    if failed:
        say(f"rank {torch_transport.rank}: {failed} of {len(chosen)} cases failed")
        sys.exit(1)
