"""Run under ``torchrun --nproc_per_node N`` (N >= 2): GradScaler across processes.

Every rank holds its own parameters (a stage's), an SGD optimizer and a
``torch.amp.GradScaler`` at scale 2^8, and gets gradients as a run leaves them, scaled;
the last rank's hold an inf. Three rounds, each from the same weights and scale:

- ``alone``: each scaler decides for itself. Every rank but the last steps (its weights
  move, its scale stays 2^8 until its growth interval), the last skips and halves: the
  ranks part ways. This is the failure ``agree_on_overflow`` exists for; the round checks
  it happens.
- ``agreed``: ``agree_on_overflow`` before ``scaler.step``: every rank reports True, no
  weight moves, every scale is 2^7.
- ``finite``: no inf anywhere: every rank reports False, every rank steps exactly as an
  unscaled SGD step would, every scale stays 2^8.

Each rank prints ``rank R <round> OK`` per round that held, then ``rank R OK``; a rank that
finds a mismatch raises, so torchrun exits non-zero.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from default_group import check, run_on_default_group

from ppswap.backends.torch.optim import agree_on_overflow

SCALE = 2.0**8
LR = 0.5


def fresh(rank: int) -> tuple[list[torch.nn.Parameter], torch.optim.SGD, torch.amp.GradScaler]:
    generator = torch.Generator().manual_seed(rank)
    params = [
        torch.nn.Parameter(torch.randn(4, 3, generator=generator)),
        torch.nn.Parameter(torch.randn(3, generator=generator)),
    ]
    optimizer = torch.optim.SGD(params, lr=LR)
    return params, optimizer, torch.amp.GradScaler("cpu", init_scale=SCALE)


def set_grads(params: list[torch.nn.Parameter], rank: int, poisoned: bool) -> list[torch.Tensor]:
    """Gradients ``g`` as a run with ``loss_scale=SCALE`` leaves them (``SCALE * g``);
    returns the unscaled ``g``."""
    generator = torch.Generator().manual_seed(100 + rank)
    unscaled = [torch.randn(p.shape, generator=generator) for p in params]
    for param, grad in zip(params, unscaled, strict=True):
        param.grad = grad * SCALE
    if poisoned:
        assert params[1].grad is not None
        params[1].grad[0] = float("inf")
    return unscaled


def one_round(rank: int, last: bool, name: str) -> None:
    params, optimizer, scaler = fresh(rank)
    before = [p.detach().clone() for p in params]
    poisoned = name != "finite" and last
    check(float(scaler.scale(torch.ones(()))) == SCALE, "the scale the run is given")  # README
    unscaled = set_grads(params, rank, poisoned)
    if name != "alone":
        verdict = agree_on_overflow(params)
        check(verdict is (name == "agreed"), f"{name}: agree_on_overflow said {verdict}")
    scaler.step(optimizer)
    scaler.update()
    moved = any(not torch.equal(p, b) for p, b in zip(params, before, strict=True))
    scale = scaler.get_scale()
    if name == "alone":
        check(moved is not last, f"alone: weights moved: {moved}")
        check(scale == (SCALE / 2 if last else SCALE), f"alone: scale {scale}")
    elif name == "agreed":
        check(not moved, "agreed: a weight moved on a skipped step")
        check(scale == SCALE / 2, f"agreed: scale {scale}, expected {SCALE / 2}")
    else:
        for param, start, grad in zip(params, before, unscaled, strict=True):
            check(torch.equal(param.detach(), start - LR * grad), "finite: not an SGD step")
        check(scale == SCALE, f"finite: scale {scale}")
    print(f"rank {rank} {name} OK", flush=True)


def every_round(rank: int, size: int) -> None:
    for name in ("alone", "agreed", "finite"):
        one_round(rank, rank == size - 1, name)
        dist.barrier()


if __name__ == "__main__":
    run_on_default_group(every_round)
