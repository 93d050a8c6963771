"""Run under ``torchrun --nproc_per_node N`` (N >= 2): ppswap against torch.distributed.pipelining.

    torchrun --standalone --nproc_per_node N peer_pipelining.py [SCHEDULE[-bf16] ...]

For each schedule (default: gpipe 1f1b interleaved_1f1b; ``-bf16``: the modules and the
batch in bfloat16, given to ppswap as torch tensors) every rank builds the same
seeded stage modules (``STAGE_NUM = N`` stages, ``2 N`` for interleaved: vpp 2, stage
``s`` on rank ``s % N``) twice: one copy runs one training step of
``torch.distributed.pipelining`` (``PipelineStage`` and ``ScheduleGPipe`` /
``Schedule1F1B`` / ``ScheduleInterleaved1F1B``, over the default gloo group), the other
the same step of ppswap over ``TorchDistTransport`` (its own gloo group), swap off and
then swap on. Same batch, same ``MICRO`` micro-batches (both split along dim 0 into equal
parts), same loss function per micro-batch.

How the two combine micro-batch losses: ppswap's gradients are those of the mean loss
(the last stage seeds each micro-batch's backward with ``1 / MICRO``); torch's schedules
with ``scale_grads=True`` (the default) sum the micro-batches' gradients and divide by
``MICRO``. Both report one loss per micro-batch, unscaled.

Checked on every rank: torch ran this rank's forwards and backwards in ppswap's compute
order (``compute_order``: the same stage, micro-batch and kind, step for step, recorded
from torch's ``forward_one_chunk`` / ``backward_one_chunk`` calls), so the two contenders
run the same schedule; the last stage's per-micro-batch losses equal (rtol 1e-6; the
script also reports whether they are bit-identical), every gradient of this rank's stages
equal (rtol 1e-5, atol 1e-5 of the tensor's largest magnitude: the two scale the
micro-batch gradients at different points; in bfloat16 that tolerance is below one ulp,
and the two are bit-identical: both add the micro-batches in order, and 1 / 8 is exact),
and swap on equal to swap off bit for bit. A rank prints
``rank R OK: SCHEDULE ...`` per schedule, or the mismatch, and exits non-zero at the end
if anything failed.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, cast

import anyio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.backends.torch.distributed import TorchDistTransport
from ppswap.scheduler.config import ScheduleConfig, ScheduleName
from ppswap.scheduler.schedules import compute_order
from ppswap.swap import swap_wrapper

DIM = 32
HIDDEN = 64
MICRO = 8
MICRO_BATCH = 4
SEQ = 6
BLOCKS_PER_STAGE = 2
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5
GRAD_ATOL_SHARE = 1e-5  # of the largest magnitude of the gradient tensor
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class Block(nn.Module):
    """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return out


def build_modules(stage_num: int, *, wrap: bool, dtype: torch.dtype) -> list[nn.Sequential]:
    """``stage_num`` stage modules of ``BLOCKS_PER_STAGE`` blocks each, from seed 0 (every
    rank and both contenders build the same weights), in ``dtype``; ``wrap``: each block
    swap-wrapped."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        modules = [
            nn.Sequential(*(Block(DIM, HIDDEN) for _ in range(BLOCKS_PER_STAGE))).to(dtype)
            for _ in range(stage_num)
        ]
    if wrap:
        for module in modules:
            for position, block in enumerate(list(module)):
                module[position] = swap_wrapper(block)
    return modules


def make_data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(MICRO * MICRO_BATCH, SEQ, DIM, generator=generator)
    y = torch.randn(MICRO * MICRO_BATCH, SEQ, DIM, generator=generator)
    return x.to(dtype), y.to(dtype)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def recording(
    method: Callable[..., Any], stage: int, kind: str, ran: list[str]
) -> Callable[..., Any]:
    """``method`` (a torch stage's ``forward_one_chunk`` / ``backward_one_chunk``, whose
    first argument is the micro-batch), appending each call to ``ran`` as ppswap writes a
    compute step (``MetaStep.short``: ``F3.0`` is the forward of micro 3 on stage 0)."""

    def call(micro: int, *args: Any, **kwargs: Any) -> Any:
        ran.append(f"{kind}{micro}.{stage}")
        return method(micro, *args, **kwargs)

    return call


def planned_order(schedule: ScheduleName, rank: int, pp: int, stage_num: int) -> list[str]:
    """ppswap's compute order of ``rank`` for this script's configuration, step by step."""
    config = ScheduleConfig(schedule=schedule, pp=pp, vpp=stage_num // pp, micro=MICRO)
    return [step.short() for step in compute_order(config, rank)]


def run_peer(
    schedule: str, rank: int, pp: int, stage_num: int, x: torch.Tensor, y: torch.Tensor
) -> tuple[list[float], dict[int, list[torch.Tensor]], list[str]]:
    """One step of torch.distributed.pipelining: the last stage's losses (empty elsewhere),
    this rank's gradients per stage index and its forwards and backwards as torch ran them."""
    modules = build_modules(stage_num, wrap=False, dtype=x.dtype)
    mine = [s for s in range(stage_num) if s % pp == rank]
    cpu = torch.device("cpu")
    stages = [TorchStage(modules[s], s, stage_num, cpu) for s in mine]
    ran: list[str] = []
    for stage in stages:  # instance attributes: the schedules call them through the stage
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
            setattr(stage, name, recording(getattr(stage, name), stage.stage_index, kind, ran))
    kinds: dict[str, Callable[..., Any]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule == "interleaved_1f1b":
        runner: Any = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO, loss_fn=mse)
    else:
        runner = kinds[schedule](stages[0], n_microbatches=MICRO, loss_fn=mse)
    losses: list[torch.Tensor] = []
    has_first, has_last = 0 in mine, stage_num - 1 in mine
    args = (x,) if has_first else ()
    if has_last:
        runner.step(*args, target=y, losses=losses)
    else:
        runner.step(*args)
    grads = {
        s: [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for p in modules[s].parameters()
        ]
        for s in mine
    }
    return [float(loss.detach()) for loss in losses], grads, ran


async def run_ppswap(
    schedule: str,
    transport: TorchDistTransport,
    stage_num: int,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    swap: bool,
) -> tuple[RunResult, dict[int, list[torch.Tensor]]]:
    modules = build_modules(stage_num, wrap=True, dtype=x.dtype)
    stages = [
        PipelineStage(m, s, stage_num)
        for s, m in enumerate(modules)
        if s % transport.world_size == transport.rank
    ]
    result = await run_schedule(
        stages,
        schedule,
        micro_batch_num=MICRO,
        # float32 as numpy arrays, bfloat16 (numpy has none) as the tensors
        inputs=x.numpy() if x.dtype is torch.float32 else x,
        targets=y.numpy() if y.dtype is torch.float32 else y,
        loss_fn=mse,
        swap=swap,
        transport=transport,
        step_timeout=120,
    )
    # read from .grad, as torch's are: the run leaves them there (the same tensors)
    if any(p.grad is not g for s in stages for p, g in zip(s.parameters, s.grads, strict=True)):
        raise AssertionError("a parameter's .grad is not the run's gradient")
    grads = {s.stage_index: [p.grad.detach().clone() for p in s.parameters] for s in stages}
    return result, grads


def compare_grads(
    want: dict[int, list[torch.Tensor]], got: dict[int, list[torch.Tensor]]
) -> tuple[list[str], float]:
    """Mismatches (stage, parameter, worst element) and the largest relative difference."""
    problems: list[str] = []
    worst = 0.0
    for stage, wanted in want.items():
        if len(wanted) != len(got[stage]):
            problems.append(f"stage {stage}: {len(got[stage])} gradients, want {len(wanted)}")
            continue
        for index, (a, b) in enumerate(zip(wanted, got[stage], strict=True)):
            scale = float(a.abs().max())
            if scale == 0.0 or not torch.isfinite(a).all():
                problems.append(f"stage {stage} grad {index}: torch's is zero or not finite")
                continue
            diff = (a - b).abs().float()
            rel = float((diff / a.abs().float().clamp_min(1e-30)).max())
            worst = max(worst, min(rel, float(diff.max()) / max(scale, 1e-30)))
            if not torch.allclose(b, a, rtol=GRAD_RTOL, atol=GRAD_ATOL_SHARE * scale):
                problems.append(
                    f"stage {stage} grad {index}: max |diff| {float(diff.max()):.3e} "
                    f"(largest |grad| {scale:.3e})"
                )
    return problems, worst


def compare_losses(want: Sequence[float], got: Sequence[float]) -> list[str]:
    if len(want) != len(got):
        return [f"{len(got)} losses, want {len(want)}"]
    if not np.allclose(got, want, rtol=LOSS_RTOL, atol=0.0):
        return [f"losses {list(got)} != torch's {list(want)}"]
    return []


async def check(name: str, transport: TorchDistTransport) -> list[str]:
    rank, pp = transport.rank, transport.world_size
    schedule = name.removesuffix("-bf16")
    dtype = torch.bfloat16 if name.endswith("-bf16") else torch.float32
    if schedule not in SCHEDULES:
        raise SystemExit(f"bad case {name!r}: expected one of {SCHEDULES}, -bf16 optional")
    stage_num = 2 * pp if schedule == "interleaved_1f1b" else pp
    x, y = make_data(dtype)
    started = time.perf_counter()
    peer_losses, peer_grads, peer_order = run_peer(schedule, rank, pp, stage_num, x, y)
    dist.barrier()
    off, off_grads = await run_ppswap(schedule, transport, stage_num, x, y, swap=False)
    on, on_grads = await run_ppswap(schedule, transport, stage_num, x, y, swap=True)
    problems: list[str] = []
    order = planned_order(cast(ScheduleName, schedule), rank, pp, stage_num)
    if peer_order != order:
        pairs = zip(peer_order, order, strict=False)  # the first difference, or the shorter end
        first = next(
            (i for i, (ran, planned) in enumerate(pairs) if ran != planned),
            min(len(peer_order), len(order)),
        )
        problems.append(
            f"torch ran {len(peer_order)} compute steps, ppswap's order has {len(order)}; "
            f"from step {first}: torch {peer_order[first : first + 4]}, "
            f"ppswap {order[first : first + 4]}"
        )
    last = stage_num - 1 in off_grads
    if last:
        problems += compare_losses(peer_losses, off.losses)
    grad_problems, worst = compare_grads(peer_grads, off_grads)
    problems += grad_problems
    if on.losses != off.losses:
        problems.append(f"swap changed the losses: {on.losses} != {off.losses}")
    for stage, grads in off_grads.items():
        if not all(torch.equal(a, b) for a, b in zip(grads, on_grads[stage], strict=True)):
            problems.append(f"swap changed stage {stage}'s gradients")
    offloaded = on.ranks[rank].offloaded_bytes
    if problems:
        for problem in problems:
            print(f"rank {rank} MISMATCH {name}: {problem}", flush=True)
    else:
        exact = "bit-identical" if last and peer_losses == off.losses else "equal"
        losses = f"{len(off.losses)} losses {exact}" if last else "losses not held here"
        print(
            f"rank {rank} OK: {name} pp{pp} stages {stage_num}: torch's order is ppswap's "
            f"({len(order)} compute steps), {losses}, "
            f"{sum(len(g) for g in off_grads.values())} gradients equal (worst relative "
            f"difference {worst:.1e}), swap on = off (offloaded {offloaded} B) "
            f"in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
    return problems


async def main(schedules: Sequence[str]) -> int:
    torch.set_num_threads(1)
    # torch.distributed.pipelining needs the default group; the transport then uses it
    # (and creates its own group for its tags) instead of initializing one itself.
    dist.init_process_group(backend="gloo")
    failed = False
    transport = TorchDistTransport()
    try:
        for schedule in schedules:
            problems = await check(schedule, transport)
            failed = failed or bool(problems)
            dist.barrier()
    except BaseException:
        traceback.print_exc()
        print(f"rank {dist.get_rank()} failed, aborting the job", flush=True)
        transport.abort(1)
    finally:
        transport.close()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(anyio.run(main, tuple(sys.argv[1:]) or SCHEDULES))
