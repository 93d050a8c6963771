"""Run under ``torchrun --nproc_per_node N`` (N >= 2): ``clip_grad_norm_`` across processes.

Every rank holds its own parameters (a stage's) with gradients drawn from a seed of its
rank, so every rank can also draw every other rank's: the reference is
``torch.nn.utils.clip_grad_norm_`` over all ranks' gradients in one process (the unsplit
model's clipping). For the 2-norm and the inf-norm, each at a ``max_norm`` that clips and
at one that does not, each rank checks that the norm returned and its clipped gradients
equal the reference's (rtol 1e-6; unchanged bit for bit where nothing is clipped); rank 0
checks that clipping its own gradients alone would have given another norm (what the
helper exists for). Prints ``rank R <case> OK`` per case and ``rank R OK``; a mismatch raises.
"""

from __future__ import annotations

import math

import torch
from default_group import check, run_on_default_group

from ppswap.backends.torch.optim import clip_grad_norm_

SHAPES = ((5, 3), (7,), (2, 2, 2))


def parameters_of(rank: int) -> list[torch.nn.Parameter]:
    """Rank ``rank``'s parameters, their gradients drawn from its seed (rank r's grow with
    r, so that one rank's norm is not the job's)."""
    generator = torch.Generator().manual_seed(rank)
    params = []
    for shape in SHAPES:
        param = torch.nn.Parameter(torch.zeros(shape))
        param.grad = torch.randn(shape, generator=generator) * (rank + 1)
        params.append(param)
    return params


def one_case(rank: int, size: int, norm_type: float, max_norm: float) -> None:
    everyone = [parameters_of(r) for r in range(size)]
    expected_norm = torch.nn.utils.clip_grad_norm_(
        [p for params in everyone for p in params], max_norm, norm_type
    )
    expected = [p.grad for p in everyone[rank]]
    mine = parameters_of(rank)
    before = [p.grad.clone() for p in mine if p.grad is not None]
    norm = clip_grad_norm_(mine, max_norm, norm_type)
    check(torch.allclose(norm, expected_norm, rtol=1e-6, atol=0), f"norm {norm} != {expected_norm}")
    for param, want, start in zip(mine, expected, before, strict=True):
        assert param.grad is not None and want is not None
        check(torch.allclose(param.grad, want, rtol=1e-6, atol=1e-12), "clipped gradients differ")
        if expected_norm <= max_norm:
            check(torch.equal(param.grad, start), "a gradient changed where nothing clips")
    if rank == 0:  # the smallest gradients: its own norm is not the job's, in either norm
        local = torch.nn.utils.clip_grad_norm_(parameters_of(rank), max_norm, norm_type)
        check(not torch.allclose(local, expected_norm, rtol=1e-3), "rank 0's norm is the job's")
    print(f"rank {rank} norm={norm_type} max_norm={max_norm} OK", flush=True)


def every_case(rank: int, size: int) -> None:
    for norm_type in (2.0, math.inf):
        for max_norm in (0.5, 1e6):
            one_case(rank, size, norm_type, max_norm)


if __name__ == "__main__":
    run_on_default_group(every_case)
