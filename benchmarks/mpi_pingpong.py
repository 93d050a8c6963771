"""What the two-process MPI benchmarks share: the launch and mpi4py's blocking ping-pong.

A script that may run without a launcher sets ``mpi4py.rc.initialize = False`` before it
imports ``mpi4py.MPI`` (or this module), so that ``relaunch_under_mpiexec`` can replace
the process with ``mpiexec -n 2`` before MPI exists in it; under the launcher it then
starts MPI itself (``MPI.Init`` or ``MPI.Init_thread``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy.typing as npt
from mpi4py import MPI

Array = npt.NDArray[Any]
LAUNCHER_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")


def under_launcher() -> bool:
    """Whether this process was started by ``mpiexec`` (or another MPI launcher)."""
    return any(name in os.environ for name in LAUNCHER_ENV)


def relaunch_under_mpiexec(script: str, argv: list[str]) -> NoReturn:
    """Replace this process with the venv's ``mpiexec -n 2`` running ``script``."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    command = [str(mpiexec), "-n", "2", sys.executable, str(Path(script).resolve()), *argv]
    os.execv(command[0], command)


def pingpong(comm: MPI.Comm, send: Array, recv: Array, iterations: int) -> float:
    """Mean one-way seconds of blocking Send/Recv ping-pong (rank 0 starts).

    Each rank sends from ``send`` and receives into ``recv`` (pass one buffer twice for
    the classic ping-pong).
    """
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        if comm.rank == 0:
            comm.Send(send, 1, 7)
            comm.Recv(recv, 1, 7)
        else:
            comm.Recv(recv, 0, 7)
            comm.Send(send, 0, 7)
    return (time.perf_counter() - start) / (2 * iterations)
