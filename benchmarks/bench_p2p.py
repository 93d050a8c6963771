"""P2P latency and bandwidth: ``MPITransport`` against mpi4py's own blocking ping-pong.

Run ``python benchmarks/bench_p2p.py`` (it re-launches itself under the venv's
``mpiexec -n 2``) or ``mpiexec -n 2 python benchmarks/bench_p2p.py`` directly.

For each payload size (1 KiB to 64 MiB, powers of 4) rank 0 and rank 1 play ping-pong:
- mpi4py: ``comm.Send`` / ``comm.Recv`` on a preallocated numpy buffer, and again with
  receives alternating between two buffers (``mpi4py 2-buffer``);
- transport: ``await transport.send`` / ``await transport.recv`` inside one anyio event
  loop per rank; each receive returns a new array, as the transport's contract says. The
  loop drops the array it holds before the next receive (one live message: the working
  set of the one-buffer ping-pong, compared with it), and again keeping the previous one
  (``transport, previous kept``: two live messages, compared with the 2-buffer run).
One-way time = round trip / 2. The four are measured back to back in each of
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
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import mpi4py

mpi4py.rc.initialize = False  # the launcher process must not start MPI before exec-ing
mpi4py.rc.finalize = True

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ppswap.actors.messages import MessageKey  # noqa: E402
from ppswap.actors.mpi import MPITransport  # noqa: E402

Array = npt.NDArray[Any]
KIB = 1024
DEFAULT_SIZES = tuple(KIB * 4**k for k in range(9))  # 1 KiB .. 64 MiB
LAUNCHER_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")
PING = MessageKey("F", 1, 0)
PONG = MessageKey("B", 0, 0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=float, default=64.0, help="largest payload (MiB)")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds per size")
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


def relaunch_under_mpiexec(argv: list[str]) -> NoReturn:
    """Replace this process with ``mpiexec -n 2`` running this script (venv's mpiexec)."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    command = [str(mpiexec), "-n", "2", sys.executable, str(Path(__file__).resolve()), *argv]
    os.execv(command[0], command)


def iterations_for(nbytes: int, round_s: float) -> int:
    """Ping-pongs per round: about ``round_s`` at an assumed 2 GB/s, between 2 and 2000."""
    estimate_s = 2 * (20e-6 + nbytes / 2e9)
    return max(2, min(2000, int(round_s / estimate_s)))


def mpi4py_pingpong(comm: MPI.Comm, buffers: list[Array], iterations: int) -> float:
    """Mean one-way seconds of blocking Send/Recv ping-pong (rank 0 starts).

    Each receive lands in the next of ``buffers`` (one: the classic ping-pong; two: the
    working set of a transport that returns a new array per message, as the pool makes
    it in steady state: the previous array is alive while the next one arrives).
    """
    comm.Barrier()
    start = time.perf_counter()
    for i in range(iterations):
        current, following = buffers[i % len(buffers)], buffers[(i + 1) % len(buffers)]
        if comm.rank == 0:
            comm.Send(current, 1, 7)
            comm.Recv(following, 1, 7)
        else:
            comm.Recv(current, 0, 7)
            comm.Send(current, 0, 7)
    return (time.perf_counter() - start) / (2 * iterations)


async def transport_pingpong(
    transport: MPITransport, payload: Array, iterations: int, keep_previous: bool
) -> tuple[float, Array]:
    """Mean one-way seconds of ping-pong through the async transport, and the last array.

    Each ``recv`` returns a new array. With ``keep_previous`` false, the loop drops the
    array it holds before the next receive, so one received message is alive at a time:
    the working set of mpi4py's one-buffer ping-pong (the receive pool hands the same
    block back). With ``keep_previous`` true, the previous message is alive while the
    next one arrives, as in the 2-buffer ping-pong.
    """
    rank = transport.rank
    message: Array | None = payload
    start = time.perf_counter()
    for _ in range(iterations):
        if rank == 0:
            assert message is not None
            await transport.send(0, 1, PING, message)
            if not keep_previous:
                message = None
            message = await transport.recv(0, 1, PONG)
        else:
            if not keep_previous:
                message = None
            message = await transport.recv(1, 0, PING)
            await transport.send(1, 0, PONG, message)
    assert message is not None
    return (time.perf_counter() - start) / (2 * iterations), message


def measure_transport(
    transport: MPITransport, payload: Array, iterations: int, keep_previous: bool
) -> float:
    transport.configure(num_stages=2, micro_count=1)
    MPI.COMM_WORLD.Barrier()
    seconds, last = anyio.run(transport_pingpong, transport, payload, iterations, keep_previous)
    if last.tobytes() != payload.tobytes():
        raise RuntimeError(f"rank {transport.rank}: ping-pong corrupted {payload.nbytes} bytes")
    return seconds


def measure(
    transport: MPITransport, sizes: list[int], rounds: int, round_s: float, stat: str
) -> list[dict[str, Any]]:
    """Per size: both ping-pongs, alternating, ``rounds`` times; ``stat`` over rounds."""
    comm = MPI.COMM_WORLD
    summarize = min if stat == "min" else statistics.median
    results: list[dict[str, Any]] = []
    for nbytes in sizes:
        payload = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
        one_buffer = [payload.copy()]
        two_buffers = [payload.copy(), payload.copy()]
        iterations = iterations_for(nbytes, round_s)
        mpi4py_pingpong(comm, two_buffers, 2)  # warm-up (connection, page faults)
        measure_transport(transport, payload, 2, keep_previous=True)
        methods: dict[str, Callable[[], float]] = {
            "mpi4py": partial(mpi4py_pingpong, comm, one_buffer, iterations),
            "mpi4py_2buf": partial(mpi4py_pingpong, comm, two_buffers, iterations),
            "transport": partial(measure_transport, transport, payload, iterations, False),
            "transport_kept": partial(measure_transport, transport, payload, iterations, True),
        }
        names = list(methods)
        rounds_s: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                # both ranks time the same round trips; keep the slower rank's figure
                rounds_s[name].append(max(comm.allgather(methods[name]())))
        one_way = {name: summarize(s) for name, s in rounds_s.items()}
        ratio = {
            pair: statistics.median(
                t / b for t, b in zip(rounds_s[pair[0]], rounds_s[pair[1]], strict=True)
            )
            for pair in (("transport", "mpi4py"), ("transport_kept", "mpi4py_2buf"))
        }
        results.append(
            {
                "bytes": nbytes,
                "iterations": iterations,
                "rounds": rounds,
                "mpi4py_us": one_way["mpi4py"] * 1e6,
                "mpi4py_2buf_us": one_way["mpi4py_2buf"] * 1e6,
                "transport_us": one_way["transport"] * 1e6,
                "transport_kept_us": one_way["transport_kept"] * 1e6,
                "overhead_pct": 100.0 * (ratio[("transport", "mpi4py")] - 1.0),
                "overhead_2buf_pct": 100.0 * (ratio[("transport_kept", "mpi4py_2buf")] - 1.0),
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
        "| size | mpi4py us | transport us | overhead % | mpi4py 2-buffer us "
        "| transport, previous kept us | overhead % | transport GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        lines.append(
            f"| {human(row['bytes'])} | {row['mpi4py_us']:.1f} | {row['transport_us']:.1f} "
            f"| {row['overhead_pct']:+.1f} | {row['mpi4py_2buf_us']:.1f} "
            f"| {row['transport_kept_us']:.1f} | {row['overhead_2buf_pct']:+.1f} "
            f"| {row['transport_gbps']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not any(name in os.environ for name in LAUNCHER_ENV):
        relaunch_under_mpiexec(argv)
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
