"""One rank of a tied GPT-2 style torch model over TorchDistTransport (``torchrun``) or
MPITransport (``mpiexec``): ``python tied.py torch|mpi``.

Stage 0 holds the embedding ``wte.weight`` and the last stage a copy of it as its head,
both declared ``tied`` under one key (``tests/tied_model.py``), on
different ranks. For 1F1B (a stage per rank) and Interleaved (two per rank), swap off and
on, and with swap on 1F1B with the dx/dw split and Interleaved with overlap_b_f, each
rank checks its loss and its stages' gradients against the unsplit model (rtol 1e-5)
and prints the SHA-256 of the tied weight's gradient where it holds a copy (``rank R
CASE tied SHA``, ``tied_digest``): the test checks that both holders print the same
digest, swap on the same as off, and the same as a run of all stages in one process.
Prints ``rank R OK`` at the end; a mismatch raises, and the rank aborts the job.
"""

from __future__ import annotations

import hashlib
import sys
import traceback
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: tied_model
from tied_model import TIED, lm_loss, tied_modules, tokens, unsplit

from ppswap import PipelineStage, run_schedule


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "1f1b": ("1f1b", 1, {}),
    "interleaved_1f1b": ("interleaved_1f1b", 2, {}),
    "1f1b_split_dw": ("1f1b", 1, {"split_dw": True}),
    "interleaved_1f1b_overlap": ("interleaved_1f1b", 2, {"overlap_b_f": True}),
}
"""Per case: the schedule, stages per rank and its other options."""
RUNS = [(name, swap) for name in list(CASES)[:2] for swap in (False, True)] + [
    (name, True) for name in list(CASES)[2:]
]


def tied_digest(stage: PipelineStage) -> str:
    """The first 16 hex digits of the SHA-256 of the stage's tied gradient."""
    name = next(iter(stage.tied))
    index = next(i for i, p in enumerate(stage.parameters) if p is _at(stage, name))
    return hashlib.sha256(stage.grads[index].numpy().tobytes()).hexdigest()[:16]


async def one_case(transport: Any, name: str, swap: bool) -> None:
    schedule, vpp, options = CASES[name]
    rank, world = transport.rank, transport.world_size
    stage_num = world * vpp
    modules = tied_modules(stage_num, shared=False)
    tied = {0: TIED[0], stage_num - 1: TIED[-1]}
    mine = [
        PipelineStage(modules[s], s, stage_num, tied=tied.get(s))
        for s in range(rank, stage_num, world)
    ]
    x, y = tokens(batch=4 * world)
    result = await run_schedule(
        mine,
        schedule,
        micro_batch_num=world,
        inputs=x,
        targets=y,
        loss_fn=lm_loss,
        swap=swap,
        transport=transport,
        step_timeout=60.0,
        **options,
    )
    want_loss, want = unsplit(stage_num, batch=4 * world)
    check(abs(result.loss - want_loss) <= 1e-5 * abs(want_loss), f"loss {result.loss}")
    case = f"{name}-swap-{'on' if swap else 'off'}"
    for stage in mine:
        reference = want[stage.stage_index]
        if stage.stage_index == stage_num - 1:  # the head's weight: the embedding's gradient
            reference = [*reference[:-1], want[0][0]]
        for grad, expected in zip(stage.grads, reference, strict=True):
            check(torch.allclose(grad, expected, rtol=1e-5, atol=1e-7), f"{case}: a gradient")
        if stage.tied:
            print(f"rank {rank} {case} tied {tied_digest(stage)}", flush=True)


def _at(stage: PipelineStage, name: str) -> Any:
    target: Any = stage.module
    for part in name.split("."):
        target = getattr(target, part)
    return target


async def main(transport: Any) -> None:
    for name, swap in RUNS:
        await one_case(transport, name, swap)
    print(f"rank {transport.rank} OK", flush=True)


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
