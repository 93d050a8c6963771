"""Run under ``torchrun --nproc_per_node N``: the last rank fails mid-run; the job must end.

Every rank exchanges one message with its neighbour, then the last rank raises while the
others wait for a message it will never send. It goes the runtime's way out
(``ppswap.transports.distributed.abort_job``: a line on stderr naming the rank, then
``TorchDistTransport.abort``), which must end every process of the job. With
``--no-abort`` the exception is left uncaught instead (the process exits with a
traceback, and torchrun has to end the rest).
"""

from __future__ import annotations

import sys
import time

import anyio
import numpy as np

from ppswap.backends.torch.distributed import TorchDistTransport
from ppswap.core.messages import MessageKey
from ppswap.transports.distributed import abort_job


class InjectedFailure(RuntimeError):
    """The failure this script injects on the last rank."""


async def main(transport: TorchDistTransport) -> None:
    rank, size = transport.rank, transport.world_size
    transport.configure(num_stages=size, micro_count=4)
    right, left = (rank + 1) % size, (rank - 1) % size
    async with anyio.create_task_group() as tg:
        tg.start_soon(transport.send, rank, right, MessageKey("F", right, 0), np.ones(8))
        await transport.recv(rank, left, MessageKey("F", rank, 0))
    if rank == size - 1:
        await anyio.sleep(0.2)  # the others are waiting by now
        print(f"rank {rank} failing at {time.time():.3f}", flush=True)
        raise InjectedFailure(f"injected failure on rank {rank}")
    # never sent: only the end of the job can end this wait
    await transport.recv(rank, size - 1, MessageKey("B", rank, 1))


if __name__ == "__main__":
    with TorchDistTransport(timeout_s=120) as torch_transport:
        if "--no-abort" in sys.argv:
            anyio.run(main, torch_transport)
        try:
            anyio.run(main, torch_transport)
        except Exception as error:
            abort_job(torch_transport, error)
