"""The caller's ``torch.autocast``, carried to the compute thread
(``TorchBackend.caller_forward_scope``).

Autocast is per thread, and a pipeline's forwards run on the runtime's compute thread, not
on the thread that awaits ``run_schedule``. So the usual mixed-precision step::

    with torch.autocast("cuda", dtype=torch.bfloat16):
        result = await run_schedule(stages, ...)

is read when the run starts (:func:`caller_autocast`, on the caller's thread): for each
device type the stages run on, whether autocast is enabled there, its dtype and whether
its weight-cast cache is. Each forward of the run, with its loss on the last stage, then
runs under the same ``torch.autocast`` on the compute thread (:func:`forward_scope`), and
each backward outside it, as torch's own recipe has it ("backward passes under autocast
are not recommended"; they run in the dtypes the forward chose). A stage module that
enters autocast itself still does; it nests.

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

__all__ = ["Autocast", "caller_autocast", "forward_scope"]


@dataclass(frozen=True, slots=True)
class Autocast:
    """``torch.autocast`` enabled for one device type: its dtype and weight-cast cache."""

    device_type: str
    dtype: torch.dtype
    cache_enabled: bool


def caller_autocast(devices: Sequence[str]) -> tuple[Autocast, ...]:
    """The autocast this thread has enabled now for the device types of ``devices``
    (``"cpu"``, ``"cuda:0"``), in name order; empty where it has none."""
    device_types = sorted({torch.device(device).type for device in devices})
    cache_enabled = torch.is_autocast_cache_enabled()
    return tuple(
        Autocast(device_type, torch.get_autocast_dtype(device_type), cache_enabled)
        for device_type in device_types
        if torch.is_autocast_enabled(device_type)
    )


def forward_scope(devices: Sequence[str]) -> ForwardScope:
    """The scope of a run's forwards: the autocast this thread has now (module docstring)."""
    settings = caller_autocast(devices)
    if not settings:
        return nullcontext

    @contextmanager
    def autocast() -> Iterator[None]:
        with ExitStack() as stack:
            for setting in settings:
                stack.enter_context(
                    torch.autocast(
                        setting.device_type,
                        dtype=setting.dtype,
                        cache_enabled=setting.cache_enabled,
                    )
                )
            yield

    return autocast
