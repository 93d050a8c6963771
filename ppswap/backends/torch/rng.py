"""A stage's own random-number stream on torch (``TorchBackend.rng_scope``).

Dropout and every other draw of a forward come from torch's default generators, which
the process shares. Ranks in one process share one compute thread, and the order in
which their forwards reach it depends on timing: with the process's generator, the masks
a forward draws would depend on what ran before it (measured: 1F1B pp4 in one process
with dropout, swap on and off alternating, different losses in 3 and in 4 of 16 runs). So each stage
draws from a stream of its own: the default generators are set to the stage's state
around each of its forwards, and what the forward leaves in them is kept for its next.
A stage's masks then depend only on its own forwards, in the order its schedule runs
them: the same with swap on and off, in one process or one per rank.

Each run draws one number from torch's default generator (``run_seed``, before any
forward); a stage's stream for that run starts from ``stage_seed(that number, stage
index)`` (for the CPU generator and, for a CUDA stage, its device's). So every process
that seeded torch alike gives each stage the same stream, whatever stages it runs (one
process or one per rank); seeding before a run repeats it; consecutive runs draw new
numbers; and stages draw distinct ones (their seeds differ), as Megatron-LM offsets each
pipeline rank's seed. The process's generator moves by that one draw per run.

The default generators are the process's, so the swap is too (as with
``torch.random.fork_rng``): a number another thread draws while a stage's forward runs
comes from, and moves, that stage's stream, and the process's generator does not keep
that draw. The runtime's own threads draw nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ppswap.backends.base import RngStream

__all__ = ["rng_scope", "run_seed", "stage_seed"]

_GOLDEN = 0x9E37_79B9_7F4A_7C15  # 2**64 / golden ratio: spreads nearby seeds apart


def run_seed() -> int:
    """One draw from torch's default CPU generator: the seed of a run's stage streams."""
    return int(torch.randint(0, 2**62, (1,)).item())


def stage_seed(seed: int, stage_index: int) -> int:
    """The seed of stage ``stage_index``'s stream in a run seeded ``seed``."""
    return (seed + _GOLDEN * (stage_index + 1)) % 2**64


@contextmanager
def rng_scope(stream: RngStream, device: torch.device) -> Iterator[None]:
    """Run the block on ``stream``'s generator states (module docstring)."""
    cuda = device.type == "cuda"
    outer = torch.get_rng_state()
    outer_cuda = torch.cuda.get_rng_state(device) if cuda else None
    if stream.state is None:
        seed = stage_seed(stream.seed, stream.stage_index)
        cpu = torch.Generator().manual_seed(seed).get_state()
        dev = torch.Generator(device=device).manual_seed(seed).get_state() if cuda else None
        stream.state = (cpu, dev)
    cpu, dev = stream.state
    torch.set_rng_state(cpu)
    if dev is not None:
        torch.cuda.set_rng_state(dev, device)
    try:
        yield
    finally:
        after = torch.cuda.get_rng_state(device) if cuda else None
        stream.state = (torch.get_rng_state(), after)
        torch.set_rng_state(outer)
        if outer_cuda is not None:
            torch.cuda.set_rng_state(outer_cuda, device)
