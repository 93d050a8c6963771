"""Two ranks of a tied GPT-2 style torch model whose last rank changes its ``tied``
declaration between runs, alone: ``python tied_redeclared.py torch|mpi``.

Run 1: both holders declare the tie and train (the last rank's head gets the embedding's
whole gradient). Then rank 1 alone drops its declaration: run 2 must be refused on
*both* ranks, at once, with the same ValueError (``declared only by stage 0``), not hang
on the rank that kept its declaration. Rank 1 declares again: run 3 trains to the
unsplit model's gradients. Each rank prints ``rank R run2 ValueError S`` (S: how many
seconds the refusal took) and ``rank R OK``; anything else raises, and the rank aborts
the job.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: tied_model
from tied_model import TIED, lm_loss, tied_modules, tokens, unsplit

from ppswap import PipelineStage, run_schedule

STEP_TIMEOUT_S = 30.0


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def equal(grads: Any, want: list[torch.Tensor]) -> bool:
    return all(torch.allclose(g, w, rtol=1e-5, atol=1e-7) for g, w in zip(grads, want, strict=True))


async def train(transport: Any, stage: PipelineStage) -> float:
    x, y = tokens(batch=8)
    result = await run_schedule(
        [stage],
        "1f1b",
        micro_batch_num=2,
        inputs=x,
        targets=y,
        loss_fn=lm_loss,
        transport=transport,
        step_timeout=STEP_TIMEOUT_S,
    )
    return result.loss


async def main(transport: Any) -> None:
    rank = transport.rank
    check(transport.world_size == 2, "two ranks")
    module = tied_modules(2, shared=False)[rank]
    declared = TIED[0] if rank == 0 else TIED[-1]
    stage = PipelineStage(module, rank, 2, tied=dict(declared))
    want_loss, want = unsplit(2, batch=8)  # its tied weight's gradient: the whole one

    await train(transport, stage)
    check(equal(stage.grads, want[rank]), "run 1 gradients")

    if rank == 1:
        stage.tied = {}  # only this rank changes its declarations
    started = time.perf_counter()
    try:
        await train(transport, stage)
    except ValueError as exc:
        check("declared only by stage 0" in str(exc), f"run 2 refused with {exc}")
        print(f"rank {rank} run2 ValueError {time.perf_counter() - started:.1f}", flush=True)
    else:
        raise AssertionError("run 2 was not refused")

    stage.tied = dict(declared)
    loss = await train(transport, stage)
    check(abs(loss - want_loss) <= 1e-5 * abs(want_loss), f"run 3 loss {loss}")
    check(equal(stage.grads, want[rank]), "run 3 gradients")
    print(f"rank {rank} OK", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["mpi"]:
        from ppswap.transports.mpi import MPITransport

        transport: Any = MPITransport()
    else:
        from ppswap.backends.torch.distributed import TorchDistTransport

        transport = TorchDistTransport(timeout_s=120)
    with transport:
        try:
            anyio.run(main, transport)
        except BaseException:
            print(f"rank {transport.rank} FAILED", file=sys.stderr, flush=True)
            traceback.print_exc()
            transport.abort(1)
