"""What an optimizer step needs from every process of a pipeline: one overflow verdict for
float16 loss scaling, one gradient norm for clipping.

In a pipeline across processes each process holds the gradients of its own stages (with
FSDP, of its shards), so a check or a norm taken in one process sees part of the model.
Both helpers take the whole job's answer with one all-reduce of one number, on every
process of ``group`` (default: all of them), after the run and before ``optimizer.step``.
Without torch.distributed initialized (every stage in one process) they need no
exchange. Only public torch API; a ``GradScaler``'s own state is not touched.

    result = await run_schedule(stages, ..., loss_scale=float(scaler.scale(one)))
    agree_on_overflow(parameters)           # float16 with a GradScaler
    scaler.unscale_(optimizer)              # clipping needs unscaled gradients
    clip_grad_norm_(parameters, max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()

- :func:`agree_on_overflow`: ``torch.amp.GradScaler`` skips a step when a gradient of its
  process is not finite, and halves its scale. One process may overflow where another
  does not: the one skips, the other steps, and their scales part ways (the stages then
  train weights no single model ever had). Where another process overflowed and this one
  did not, this one's first gradient is filled with NaN, so that its scaler skips and
  backs off as every other process does.
- :func:`clip_grad_norm_`: ``torch.nn.utils.clip_grad_norm_`` over every process's
  gradients, from torch's own two halves of it. Each process takes the norm of its own
  gradients (``get_total_norm``); the job's norm joins them (the sum of their
  ``norm_type``-th powers, in float64; the largest for ``inf``); every process scales its
  gradients by it (``clip_grads_with_norm_``). Gradients count once each: a parameter
  two processes share (tied embeddings, its ``.grad`` all-reduced between them) counts
  in both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["agree_on_overflow", "clip_grad_norm_"]


def agree_on_overflow(
    parameters: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
) -> bool:
    """Whether any process of ``group`` has a ``.grad`` that is not finite; if one has and
    this process has none, this process's first non-empty ``.grad`` is filled with NaN
    (the step is skipped, the next ``zero_grad`` clears it). A collective: call it on
    every process of ``group``, before ``scaler.step``. ``parameters``: this process's,
    those its optimizer steps.
    """
    grads = _grads(parameters)
    local = bool(grads) and not bool(torch.stack([g.isfinite().all() for g in grads]).all())
    if not _distributed():
        return local
    verdict = torch.tensor([1.0 if local else 0.0], device=_collective_device(group))
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    overflowed = bool(verdict.item())
    if overflowed and not local:
        if not grads:
            raise RuntimeError(
                "agree_on_overflow: another process overflowed, and no parameter of this "
                "process has a gradient to mark: its GradScaler cannot skip the step"
            )
        with torch.no_grad():
            grads[0].fill_(float("nan"))
    return overflowed


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale every process's gradients so that the norm of all of them together is at most
    ``max_norm``; return that norm (as ``torch.nn.utils.clip_grad_norm_``, of which it is
    the whole-job form: in one process it is that function). A collective: call it on
    every process of ``group``, with unscaled gradients.
    """
    params = list(parameters)
    grads = _grads(params)
    if not _is_real(max_norm) or not 0 <= max_norm < math.inf:
        raise ValueError(f"max_norm={max_norm!r}; allowed: a finite number >= 0")
    if not _is_real(norm_type) or not norm_type > 0:
        raise ValueError(f"norm_type={norm_type!r}; allowed: a number > 0 or math.inf")
    if not _distributed():
        norm: torch.Tensor = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        return norm
    local = torch.nn.utils.get_total_norm(grads, norm_type)
    joined = local.to(_collective_device(group), torch.float64).reshape(1)
    if math.isinf(norm_type):
        dist.all_reduce(joined, op=dist.ReduceOp.MAX, group=group)
        total = joined[0]
    else:
        joined.pow_(norm_type)
        dist.all_reduce(joined, op=dist.ReduceOp.SUM, group=group)
        total = joined[0].pow(1.0 / norm_type)
    total_norm: torch.Tensor = total.to(local.device, local.dtype)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm


def _grads(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The non-empty ``.grad`` of each of ``parameters`` (TypeError naming a non-tensor)."""
    grads = []
    for index, param in enumerate(parameters):
        if not isinstance(param, torch.Tensor):
            raise TypeError(
                f"parameters must be torch tensors, got {type(param).__name__} at index {index}"
            )
        if param.grad is not None and param.grad.numel() > 0:
            grads.append(param.grad)
    return grads


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor for a collective of ``group`` lives: CUDA for NCCL, else the CPU."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
