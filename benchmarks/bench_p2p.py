"""P2P latency and bandwidth: ``MPITransport`` against mpi4py's own blocking ping-pong.

Run ``python benchmarks/bench_p2p.py`` (it re-launches itself under the venv's
``mpiexec -n 2``) or ``mpiexec -n 2 python benchmarks/bench_p2p.py`` directly.

For each payload size (1 KiB to 64 MiB, powers of 4) rank 0 and rank 1 play ping-pong
three ways:
- ``transport``: ``await transport.send`` / ``await transport.recv`` inside one anyio
  event loop per rank. Each receive returns a new array, as the transport's contract
  says; the loop drops the array it holds before the next receive, so one received
  message is alive at a time and the receive pool hands the same block back;
- ``mpi4py, same memory``: blocking ``comm.Send`` / ``comm.Recv`` on the very array the
  transport last returned on this rank (so on the transport's pool block). The
  transport's overhead is measured against this one;
- ``mpi4py, own buffer``: the classic ping-pong on a numpy buffer of its own.
Both mpi4py runs are the same code on different memory, and they differ by up to 20% at
4 MiB on this machine (a single-copy transfer's speed depends on where both processes'
pages lie), which is why the overhead is taken on the same memory; the overhead against
the own buffer is shown as well.

One-way time = round trip / 2. The three are measured back to back in each of
``--rounds`` rounds, in an order that rotates from round to round. The time columns show
the minimum over rounds (``--stat median`` for the median), the round that other
processes on the machine disturbed least. The overhead columns are the median over
rounds of the per-round ratio transport / mpi4py: both halves of a ratio ran within the
same few tens of milliseconds, so a disturbance that slows the machine for a while
cancels out instead of landing on one method's minimum. Every transport round checks
that the array that came back is bit-identical to the one sent.
Rank 0 prints a markdown table; ``--json PATH`` also writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import mpi4py

mpi4py.rc.initialize = False  # the launcher process must not start MPI before exec-ing
mpi4py.rc.finalize = True

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
from mpi4py import MPI  # noqa: E402
from mpi_pingpong import pingpong, relaunch_under_mpiexec, under_launcher  # noqa: E402

from ppswap.core.messages import MessageKey  # noqa: E402
from ppswap.transports.mpi import MPITransport  # noqa: E402

Array = npt.NDArray[Any]
KIB = 1024
DEFAULT_SIZES = tuple(KIB * 4**k for k in range(9))  # 1 KiB .. 64 MiB
PING = MessageKey("F", 1, 0)
PONG = MessageKey("B", 0, 0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=float, default=64.0, help="largest payload (MiB)")
    parser.add_argument("--rounds", type=int, default=25, help="rotating rounds per size")
    parser.add_argument(
        "--round-s", type=float, default=0.03, help="target seconds per method per round"
    )
    parser.add_argument(
        "--stat",
        choices=("min", "median"),
        default="min",
        help="statistic over rounds (min: least disturbed by other processes)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    return parser.parse_args(argv)


def iterations_for(nbytes: int, round_s: float) -> int:
    """Ping-pongs per round: about ``round_s`` at an assumed 8 GB/s, between 2 and 2000.

    8 GB/s is about what this machine's single-copy transfers reach; the 2 GB/s assumed
    until 2026-11-29 gave 7 round trips per round at 4 MiB, so the first, cold round
    trip of each round weighed on the figure.
    """
    estimate_s = 2 * (10e-6 + nbytes / 8e9)
    return max(2, min(2000, int(round_s / estimate_s)))


def mpi4py_pingpong(comm: MPI.Comm, buffer: Array, iterations: int) -> float:
    """Mean one-way seconds of blocking Send/Recv ping-pong on ``buffer`` (rank 0 starts)."""
    return pingpong(comm, buffer, buffer, iterations)


def mpi4py_on_held(comm: MPI.Comm, held: list[Array], iterations: int) -> float:
    """``mpi4py_pingpong`` on the array the transport returned last (``held[0]``)."""
    return mpi4py_pingpong(comm, held[0], iterations)


async def transport_pingpong(transport: MPITransport, held: list[Array], iterations: int) -> float:
    """Mean one-way seconds of ping-pong through the async transport.

    ``held`` holds one array: rank 0 sends it first. It is taken out of the list, and the
    loop drops each array once it is sent (rank 0) or before the next receive (rank 1),
    so one received message is alive at a time and the pool hands back the same block;
    the last array received goes back into ``held``.
    """
    rank = transport.rank
    message: Array | None = held.pop()
    # The clock starts once both ranks' event loops run, as mpi4py's starts after its
    # Barrier: a barrier before ``anyio.run`` left the loops' start-up skew (hundreds of
    # microseconds) in the first round trip, which at 4 MiB (7 round trips per round) was
    # +10-35 points of "overhead". Blocking the loop here is fine: nothing else runs on it.
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        if rank == 0:
            assert message is not None
            await transport.send(0, 1, PING, message)
            message = None
            message = await transport.recv(0, 1, PONG)
        else:
            message = None
            message = await transport.recv(1, 0, PING)
            await transport.send(1, 0, PONG, message)
    assert message is not None
    held.append(message)
    return (time.perf_counter() - start) / (2 * iterations)


def measure_transport(
    transport: MPITransport, held: list[Array], payload: Array, iterations: int
) -> float:
    transport.configure(num_stages=2, micro_count=1)
    seconds = anyio.run(transport_pingpong, transport, held, iterations)
    if not np.array_equal(held[0], payload):
        raise RuntimeError(f"rank {transport.rank}: ping-pong corrupted {payload.nbytes} bytes")
    return seconds


def overhead_pct(rounds_s: dict[str, list[float]], baseline: str) -> float:
    """The median over rounds of transport / ``baseline``, as a percentage above 1."""
    ratios = zip(rounds_s["transport"], rounds_s[baseline], strict=True)
    return 100.0 * (statistics.median(t / b for t, b in ratios) - 1.0)


def measure(
    transport: MPITransport, sizes: list[int], rounds: int, round_s: float, stat: str
) -> list[dict[str, Any]]:
    """Per size: the three ping-pongs, rotating, ``rounds`` times; ``stat`` over rounds."""
    comm = MPI.COMM_WORLD
    summarize = min if stat == "min" else statistics.median
    results: list[dict[str, Any]] = []
    for nbytes in sizes:
        payload = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
        own_buffer = payload.copy()
        held = [payload.copy()]  # after the warm-up: the array the transport returned
        iterations = iterations_for(nbytes, round_s)
        methods: dict[str, Callable[[], float]] = {
            "transport": partial(measure_transport, transport, held, payload, iterations),
            "mpi4py_same": partial(mpi4py_on_held, comm, held, iterations),
            "mpi4py_own": partial(mpi4py_pingpong, comm, own_buffer, iterations),
        }
        for method in methods.values():  # warm-up: connections, page faults, the pool
            method()
        names = list(methods)
        rounds_s: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                # both ranks time the same round trips; keep the slower rank's figure
                rounds_s[name].append(max(comm.allgather(methods[name]())))
        one_way = {name: summarize(s) for name, s in rounds_s.items()}
        results.append(
            {
                "bytes": nbytes,
                "iterations": iterations,
                "rounds": rounds,
                "transport_us": one_way["transport"] * 1e6,
                "mpi4py_same_us": one_way["mpi4py_same"] * 1e6,
                "mpi4py_own_us": one_way["mpi4py_own"] * 1e6,
                "overhead_pct": overhead_pct(rounds_s, "mpi4py_same"),
                "overhead_own_pct": overhead_pct(rounds_s, "mpi4py_own"),
                "transport_gbps": nbytes / one_way["transport"] / 1e9,
                "rounds_us": {name: [x * 1e6 for x in s] for name, s in rounds_s.items()},
            }
        )
    return results


def human(nbytes: float) -> str:
    for unit, scale in (("MiB", KIB * KIB), ("KiB", KIB)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def markdown_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| size | transport us | mpi4py, same memory us | overhead % "
        "| mpi4py, own buffer us | overhead vs own buffer % | transport GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        lines.append(
            f"| {human(row['bytes'])} | {row['transport_us']:.1f} "
            f"| {row['mpi4py_same_us']:.1f} | {row['overhead_pct']:+.1f} "
            f"| {row['mpi4py_own_us']:.1f} | {row['overhead_own_pct']:+.1f} "
            f"| {row['transport_gbps']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not under_launcher():
        relaunch_under_mpiexec(__file__, argv)
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    if MPI.COMM_WORLD.Get_size() != 2:
        print("bench_p2p needs exactly 2 ranks (mpiexec -n 2)", file=sys.stderr)
        return 2
    sizes = [n for n in DEFAULT_SIZES if n <= args.max_mib * KIB * KIB]
    with MPITransport() as transport:
        results = measure(transport, sizes, args.rounds, args.round_s, args.stat)
    if MPI.COMM_WORLD.rank == 0:
        print(f"MPI: {MPI.Get_library_version().splitlines()[0]}; mpi4py {mpi4py.__version__}")
        print(
            f"one-way time = round trip / 2; times: {args.stat} of {args.rounds} rounds; "
            "overheads: median of per-round ratios"
        )
        print(markdown_table(results))
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
