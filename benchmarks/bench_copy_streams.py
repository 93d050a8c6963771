"""How long a load waits behind an unrelated offload: one copy stream against two.

    python benchmarks/bench_copy_streams.py [--rounds 20] [--offload-mib 64]
        [--load-mib 16] [--gbps 2] [--json PATH]

A rank's ``CopyStream`` (``ppswap/actors/copy_stream.py``) runs offloads and loads on two
threads by default (``split_directions=True``), as a GPU's two copy engines run D2H and H2D
at once; ``split_directions=False`` runs them on one thread in launch order. Each round
launches an offload of ``--offload-mib`` MiB (one chunk's activations to the host), then at
once a load of ``--load-mib`` MiB of another chunk (its backward is next), both real
``EmulatedDevice`` copies (``numpy`` memcpy of real buffers) held to ``--gbps`` GB/s in
each direction, as on a PCIe link (the default is low enough that the emulated link, not
the host's memcpy on a small machine, sets each copy's time). Reported per mode: the
load's exposed wait (from its launch to its completion, less its own copy time at that
bandwidth), median and max over ``--rounds`` rounds, and the round's wall time. With one
stream the load waits for the whole offload; with two it waits only for its own copy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from ppswap.actors.copy_stream import CopyCompletion, CopyStream
from ppswap.actors.trace import FlightRecorder
from ppswap.backends.cpu_engine import EmulatedDevice
from ppswap.scheduler.steps import MetaStep, StepKind
from ppswap.swap.jobs import CopyJob, JobKind

MIB = 1 << 20


def _jobs(engine: EmulatedDevice, offload_bytes: int, load_bytes: int) -> tuple[CopyJob, CopyJob]:
    """An offload job and a load job of real buffers of those sizes."""
    source = np.ones(offload_bytes, dtype=np.uint8)
    host = engine.acquire_host(load_bytes)
    host[:] = 7

    def offload() -> None:
        (copied,) = engine.d2h_many([source])
        engine.release_host(copied)

    def load() -> None:
        engine.h2d_block([host], [0], load_bytes)
        engine.release_host(host)

    return (
        CopyJob(kind=JobKind.OFFLOAD, group="offload", nbytes=offload_bytes, work=offload),
        CopyJob(kind=JobKind.LOAD, group="load", nbytes=load_bytes, work=load),
    )


async def _measure(split: bool, args: argparse.Namespace) -> dict[str, Any]:
    engine = EmulatedDevice(d2h_gbps=args.gbps, h2d_gbps=args.gbps)
    offload_bytes, load_bytes = args.offload_mib * MIB, args.load_mib * MIB
    own_s = load_bytes / (args.gbps * 1e9)
    stream = CopyStream(0, FlightRecorder(), split_directions=split)
    stream.start()
    waits: list[float] = []
    walls: list[float] = []
    try:
        for round_index in range(args.rounds + 1):  # the first round warms the pools up
            offload, load = _jobs(engine, offload_bytes, load_bytes)
            started = time.perf_counter()
            offloaded = stream.launch(
                MetaStep(StepKind.SWAP_LAUNCH_OFFLOAD, 0, round_index), offload
            )
            loaded: CopyCompletion = stream.launch(
                MetaStep(StepKind.SWAP_LAUNCH_LOAD, 1, round_index), load
            )
            if not await loaded.wait_async(60.0):
                raise TimeoutError("the load did not finish within 60 s")
            load_done = time.perf_counter()
            if not await offloaded.wait_async(60.0):
                raise TimeoutError("the offload did not finish within 60 s")
            if round_index:
                waits.append(max(0.0, load_done - started - own_s))
                walls.append(time.perf_counter() - started)
    finally:
        stream.close()
        with anyio.fail_after(60):
            await stream.finished()
        await stream.join(60.0)
    return {
        "streams": 2 if split else 1,
        "load_wait_ms_median": statistics.median(waits) * 1e3,
        "load_wait_ms_max": max(waits) * 1e3,
        "round_ms_median": statistics.median(walls) * 1e3,
    }


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [await _measure(False, args), await _measure(True, args)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--offload-mib", type=int, default=64)
    parser.add_argument("--load-mib", type=int, default=16)
    parser.add_argument("--gbps", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    for name in ("rounds", "offload_mib", "load_mib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.gbps > 0:
        parser.error(f"--gbps must be > 0, got {args.gbps}")
    rows = anyio.run(_main, args)
    print(
        f"offload {args.offload_mib} MiB, then a load of {args.load_mib} MiB, "
        f"{args.gbps:g} GB/s each way, {args.rounds} rounds"
    )
    print("| copy streams | load's exposed wait, median (ms) | max (ms) | round (ms) |")
    print("|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['streams']} | {row['load_wait_ms_median']:.1f} | "
            f"{row['load_wait_ms_max']:.1f} | {row['round_ms_median']:.1f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
