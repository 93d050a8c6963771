"""Run under ``mpiexec -n N``: the last rank fails mid-run; the job must end, not hang.

Every rank exchanges one message with its neighbour, then the last rank raises while the
others wait for a message it will never send. The failing rank reports itself on stderr
and calls ``MPITransport.abort``, which must end every process of the job. With the
argument ``--no-abort`` the exception is left uncaught instead (to see what the launcher
does on its own).
"""

from __future__ import annotations

import sys
import time

import anyio
import numpy as np

from ppswap.core.messages import MessageKey
from ppswap.transports.mpi import MPITransport


class InjectedFailure(RuntimeError):
    """The failure this script injects on the last rank."""


async def main(transport: MPITransport) -> None:
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
    # never sent: only the abort can end this wait
    await transport.recv(rank, size - 1, MessageKey("B", rank, 1))


if __name__ == "__main__":
    use_abort = "--no-abort" not in sys.argv
    with MPITransport() as mpi_transport:
        if not use_abort:
            anyio.run(main, mpi_transport)
        try:
            anyio.run(main, mpi_transport)
        except BaseException as error:
            print(f"rank {mpi_transport.rank} failed: {error!r}", file=sys.stderr, flush=True)
            print(f"rank {mpi_transport.rank} calls MPI_Abort", file=sys.stderr, flush=True)
            mpi_transport.abort(1)
