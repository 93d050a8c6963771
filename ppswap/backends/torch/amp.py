"""Float16 loss scaling across the processes of a pipeline: one overflow verdict for all.

``torch.amp.GradScaler`` decides per process whether a step overflowed (a gradient with an
inf or a NaN): it then skips ``optimizer.step`` and halves its scale. In a pipeline across
processes each process holds the gradients of other stages, so one process may overflow
where another does not: the one skips, the other steps, and their scales part ways; the
stages then train on weights no single model ever had. :func:`agree_on_overflow`, called
between the run and ``scaler.step``, all-reduces the verdict and, where another process
overflowed and this one did not, fills one of this process's gradients with NaN, so that
its scaler finds the overflow too, skips and backs off as every other process does. Only
public torch API: the scaler's own state is not touched.

    result = await run_schedule(stages, ..., loss_scale=float(scaler.scale(one)))
    agree_on_overflow(parameters)   # before scaler.step, on every process
    scaler.step(optimizer)
    scaler.update()

Without torch.distributed initialized (every stage in one process, one scaler sees every
gradient) nothing is exchanged: it returns this process's verdict.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["agree_on_overflow"]


def agree_on_overflow(
    parameters: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
) -> bool:
    """Whether any process of ``group`` (default: every process) has a ``.grad`` that is
    not finite; if one has and this process has none, this process's first non-empty
    ``.grad`` is filled with NaN (the step is skipped, the next ``zero_grad`` clears it).

    Call it on every process of ``group``, after the run and before ``scaler.step``: it
    is a collective (one all-reduce of one number). ``parameters``: this process's
    parameters, those its optimizer steps.
    """
    params = list(parameters)
    for index, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise TypeError(
                f"parameters must be torch tensors, got {type(param).__name__} at index {index}"
            )
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel() > 0]
    local = bool(grads) and not bool(torch.stack([g.isfinite().all() for g in grads]).all())
    if not (dist.is_available() and dist.is_initialized()):
        return local
    device = torch.device("cpu")
    if dist.get_backend(group) == dist.Backend.NCCL:
        device = torch.device("cuda", torch.cuda.current_device())
    verdict = torch.tensor([1.0 if local else 0.0], device=device)
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
