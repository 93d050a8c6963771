"""What the torchrun test scripts that use torch.distributed's default gloo group directly
(``clip.py``, ``overflow.py``) share: joining and leaving the group, and a failed check.

A rank that passed leaves without finalizing its interpreter. gloo can abort a process
while it finalizes, after ``destroy_process_group`` ("terminate called without an active
exception", SIGABRT; seen once in a CI run of ``overflow.py`` after every rank had printed
its OK, and in none of 20 runs here). That is gloo's teardown, not what these scripts
test. A rank that fails raises and exits as usual, non-zero.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

__all__ = ["check", "run_on_default_group"]


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def run_on_default_group(body: Callable[[int, int], None]) -> NoReturn:
    """Join the default gloo group, run ``body(rank, world_size)``, print ``rank R OK``,
    leave the group, and end the process with status 0 (its output flushed)."""
    dist.init_process_group(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    try:
        body(rank, size)
        print(f"rank {rank} OK", flush=True)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
