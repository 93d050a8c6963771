"""The caller's per-thread torch settings, carried to the compute thread
(``TorchBackend.caller_forward_scope``): ``torch.autocast`` and the current CUDA device.

Both are per thread, and a pipeline's forwards run on the runtime's compute thread, not
on the thread that awaits ``run_schedule``. So the usual mixed-precision step::

    torch.cuda.set_device(local_rank)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        result = await run_schedule(stages, ...)

is read when the run starts (:func:`caller_settings`, on the caller's thread): for each
device type the stages run on, whether autocast is enabled there, its dtype and whether
its weight-cast cache is; and, for stages on CUDA, the current CUDA device (what
``device="cuda"`` and ``torch.cuda.current_stream()`` mean in a module's forward). Each
forward of the run, with its loss on the last stage, then runs under the same settings on
the compute thread (:func:`forward_scope`), and each backward outside autocast, as torch's
own recipe has it ("backward passes under autocast are not recommended"; they run in the
dtypes the forward chose). A stage module that enters autocast itself still does; it
nests.

Each forward enters autocast anew, so its weight casts are cached for that forward only
and saved for its backward as activations are (they are not parameters: swap may move
them), as when the module enters autocast itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ppswap.backends.base import ForwardScope

__all__ = ["Autocast", "CallerSettings", "caller_settings", "forward_scope"]


@dataclass(frozen=True, slots=True)
class Autocast:
    """``torch.autocast`` enabled for one device type: its dtype and weight-cast cache."""

    device_type: str
    dtype: torch.dtype
    cache_enabled: bool


@dataclass(frozen=True, slots=True)
class CallerSettings:
    """What a run's forwards take from the thread that called ``run_schedule``."""

    autocast: tuple[Autocast, ...]
    cuda_device: int | None  # the current CUDA device, where a stage is on CUDA


def caller_settings(devices: Sequence[str]) -> CallerSettings:
    """This thread's settings now for stages on ``devices`` (``"cpu"``, ``"cuda:0"``):
    autocast per device type, in name order, and the current CUDA device."""
    device_types = sorted({torch.device(device).type for device in devices})
    cache_enabled = torch.is_autocast_cache_enabled()
    autocast = tuple(
        Autocast(device_type, torch.get_autocast_dtype(device_type), cache_enabled)
        for device_type in device_types
        if torch.is_autocast_enabled(device_type)
    )
    # The stages' parameters are on CUDA, so CUDA is initialized: this initializes nothing.
    cuda_device = torch.cuda.current_device() if "cuda" in device_types else None
    return CallerSettings(autocast, cuda_device)


def forward_scope(devices: Sequence[str]) -> ForwardScope:
    """The scope of a run's forwards: this thread's settings now (module docstring)."""
    settings = caller_settings(devices)
    if not settings.autocast and settings.cuda_device is None:
        return nullcontext

    @contextmanager
    def scope() -> Iterator[None]:
        with ExitStack() as stack:
            if settings.cuda_device is not None:
                stack.enter_context(torch.cuda.device(settings.cuda_device))
            for setting in settings.autocast:
                stack.enter_context(
                    torch.autocast(
                        setting.device_type,
                        dtype=setting.dtype,
                        cache_enabled=setting.cache_enabled,
                    )
                )
            yield

    return scope
