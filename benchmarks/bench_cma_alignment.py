"""Single-copy (CMA) transfer speed against where the buffers lie in their pages.

Why ``MPITransport`` places each received body at the page offset of the sender's buffer
(``RecvBufferPool.take(nbytes, page_offset)``): on this machine a transfer into a
destination that starts a few bytes further into its page than the source ran several
times slower.

Run ``python benchmarks/bench_cma_alignment.py`` (it re-launches itself under the
venv's ``mpiexec -n 2``). For each size, blocking mpi4py ping-pongs between two ranks:
rank 0 sends from a buffer at page offset 0, rank 1 receives into a buffer that starts
``d`` bytes further into its page, and the way back is aligned (rank 1 sends from offset
0 into rank 0's offset 0), so only one direction varies. The buffers lie in 2 MiB-aligned
arenas, so huge pages do not differ between them. Each ``d`` runs in every one of
``--rounds`` rounds, in an order that rotates; the table shows the median over rounds of
the ratio to ``d = 0``. Rank 0 prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import mpi4py

mpi4py.rc.initialize = False  # the launcher process must not start MPI before exec-ing
mpi4py.rc.finalize = True

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
from mpi4py import MPI  # noqa: E402
from mpi_pingpong import pingpong, relaunch_under_mpiexec, under_launcher  # noqa: E402

Array = npt.NDArray[Any]
PAGE = 4096
HUGE_PAGE = 2 << 20
OFFSETS = (0, 8, 16, 32, 48, 64, 2048, PAGE - 16)


def placed(nbytes: int, page_offset: int, keep: list[Array]) -> Array:
    """``nbytes`` at ``page_offset`` bytes into a page of a 2 MiB-aligned arena."""
    arena = np.ones(nbytes + 2 * PAGE + HUGE_PAGE, dtype=np.uint8)
    keep.append(arena)
    start = (-arena.ctypes.data) % HUGE_PAGE + page_offset
    return arena[start : start + nbytes]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args(argv)
    if not under_launcher():
        relaunch_under_mpiexec(__file__, argv)
    MPI.Init()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        print("bench_cma_alignment needs exactly 2 ranks", file=sys.stderr)
        return 2
    rows = []
    keep: list[Array] = []
    for mib in args.sizes_mib:
        nbytes = int(mib * (1 << 20))
        iterations = max(4, int(0.03 / (2 * (10e-6 + nbytes / 8e9))))
        # rank 0 receives (the way back) at offset 0; rank 1 receives at offset d
        pairs = {
            d: (placed(nbytes, 0, keep), placed(nbytes, d if comm.rank == 1 else 0, keep))
            for d in OFFSETS
        }
        for send, recv in pairs.values():  # warm-up: page faults
            pingpong(comm, send, recv, 2)
        seconds: dict[int, list[float]] = {d: [] for d in OFFSETS}
        for round_index in range(args.rounds):
            shift = round_index % len(OFFSETS)
            for d in OFFSETS[shift:] + OFFSETS[:shift]:
                one_way = pingpong(comm, *pairs[d], iterations)
                seconds[d].append(max(comm.allgather(one_way)))
        ratios = {
            d: statistics.median(a / b for a, b in zip(seconds[d], seconds[0], strict=True))
            for d in OFFSETS
        }
        rows.append((mib, min(seconds[0]) * 1e6, ratios))
    if comm.rank == 0:
        print("one-way time with the forward destination d bytes further into its page")
        print("| size | d = 0 us | " + " | ".join(f"d = {d}" for d in OFFSETS[1:]) + " |")
        print("|---:|---:|" + "---:|" * (len(OFFSETS) - 1))
        for mib, base_us, ratios in rows:
            cells = " | ".join(f"{ratios[d]:.2f}x" for d in OFFSETS[1:])
            print(f"| {mib:g} MiB | {base_us:.1f} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
