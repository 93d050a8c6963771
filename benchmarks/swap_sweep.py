"""Swap's step cost by chunk size on one backend: the worker of ``bench_swap_overhead --sweep``.

    python benchmarks/bench_swap_overhead.py --sweep [--backends mindspore,torch]
        [--sizes 64K,160K,1M,8M,64M] [--schedules gpipe,interleaved_1f1b] [--pairs 5]
        [--micro 8] [--json FILE]

Each backend runs in a process of its own (``--backend NAME``: this script as that
process, printing one JSON line per row); the table is printed as markdown.

The model: stages of eight ``swap_wrapper``-ed blocks (a width-128 linear layer and a
tanh) and one plain linear layer, so autograd saves eight activations per chunk that swap
may move (the tanh outputs; the first block's input is the stage input, protected, and the
last linear layer's output is not saved), each a ``tokens x 128`` float32 tensor in a
storage of its own. A chunk of ``S`` bytes is ``S / 4096`` tokens per micro-batch: the
compute per chunk grows with the bytes, as a longer sequence's does. GPipe runs pp2 (two
stages), Interleaved 1F1B pp2 vpp2 (four stages), every rank in this process, copies
unthrottled (the CPU engine's memcpy), the default gap plan.

Per size and schedule: ``--pairs`` pairs of runs, each pair a run without swap and one with
it, the two alternating (which goes first alternates too); per pair the ratio of the step
times (wall) and of the process CPU time (``time.process_time``: every thread, the compute
thread's work, the copy threads' and the event loop's; steadier than wall time where other
load shares the cores); reported: the medians of the pairs' ratios, the ratios of each
contender's least time (other load only adds time; on a shared 2-core host with MindSpore,
whose kernel threads wait by spinning, a single step can take 2-4 times its least), and
what swap adds in process CPU time per chunk swapped (the median pair's difference over
the chunks the plan swapped). Losses are checked equal, swap on and off, in every pair.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from ppswap import PipelineStage, run_schedule
from ppswap.backends import backend_for
from ppswap.swap import (
    EmulatedDevice,
    PipelineSwapSession,
    SwapManager,
    module_state_tensors,
    swap_wrapper,
)

WIDTH = 128
BLOCKS_PER_STAGE = 8
BYTES_PER_TOKEN = BLOCKS_PER_STAGE * WIDTH * 4
SCHEDULES = {"gpipe": (2, 2), "interleaved_1f1b": (2, 4)}
"""Schedule -> (pp, stages)."""


def parse_size(text: str) -> int:
    """``"160K"``, ``"8M"`` or a byte count -> bytes; a multiple of one token's bytes."""
    units = {"K": 1024, "M": 1024**2}
    text = text.strip().upper()
    value = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    if value < BYTES_PER_TOKEN or value % BYTES_PER_TOKEN:
        raise ValueError(
            f"a chunk size must be a positive multiple of {BYTES_PER_TOKEN} bytes (one "
            f"token's eight saved activations), got {text!r}"
        )
    return value


def size_label(nbytes: int) -> str:
    return f"{nbytes // 1024**2}M" if nbytes % 1024**2 == 0 else f"{nbytes // 1024}K"


def _mindspore_stage(seed: int) -> tuple[Any, Callable[..., Any]]:
    import mindspore as ms
    from mindspore import nn, ops

    class Block(nn.Cell):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Dense(WIDTH, WIDTH)
            self.act = nn.Tanh()

        def construct(self, x: Any) -> Any:
            return self.act(self.fc(x))

    ms.set_seed(seed)
    layers = [swap_wrapper(Block()) for _ in range(BLOCKS_PER_STAGE)]
    module = nn.SequentialCell([*layers, nn.Dense(WIDTH, WIDTH)])

    def loss(output: Any, target: Any) -> Any:
        return ops.mean((output - target) ** 2)

    return module, loss


def _torch_stage(seed: int) -> tuple[Any, Callable[..., Any]]:
    import torch

    torch.manual_seed(seed)
    layers = [
        swap_wrapper(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()))
        for _ in range(BLOCKS_PER_STAGE)
    ]
    module = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, WIDTH))

    def loss(output: Any, target: Any) -> Any:
        return ((output - target) ** 2).mean()

    return module, loss


def configure(backend: str) -> None:
    if backend == "mindspore":
        import mindspore as ms

        ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    else:
        import torch

        torch.set_num_threads(1)


@dataclass
class Case:
    """One schedule at one chunk size: its stages and batch, kept across runs."""

    backend: str
    schedule: str
    chunk_bytes: int
    micro: int

    def __post_init__(self) -> None:
        pp, stage_num = SCHEDULES[self.schedule]
        self.pp = pp
        make = _mindspore_stage if self.backend == "mindspore" else _torch_stage
        self.stages = []
        for index in range(stage_num):
            module, self.loss = make(index)
            self.stages.append(PipelineStage(module, index, stage_num))
        tokens = self.chunk_bytes // BYTES_PER_TOKEN
        rng = np.random.default_rng(0)
        shape = (self.micro * tokens, WIDTH)
        self.inputs = rng.standard_normal(shape).astype(np.float32)
        self.targets = rng.standard_normal(shape).astype(np.float32)

    def run(self, swap: bool) -> tuple[float, float, Any]:
        """One run: (wall s, process CPU s, result)."""
        gc.collect()
        cpu = time.process_time()
        result = anyio.run(self._run, swap)
        return result.step_time_s, time.process_time() - cpu, result

    async def _run(self, swap: bool) -> Any:
        return await run_schedule(
            self.stages,
            self.schedule,
            micro_batch_num=self.micro,
            inputs=self.inputs,
            targets=self.targets,
            loss_fn=self.loss,
            swap=swap,
            pp=self.pp,
        )


def measure(case: Case, pairs: int) -> dict[str, Any]:
    """``pairs`` alternating pairs of runs without and with swap (module docstring)."""
    case.run(False)  # warm-up: first calls, pools, caches
    case.run(True)
    walls: list[tuple[float, float]] = []
    cpus: list[tuple[float, float]] = []
    swapped = moved = 0
    for pair in range(pairs):
        got: dict[bool, tuple[float, float, Any]] = {}
        for swap in (False, True) if pair % 2 == 0 else (True, False):
            got[swap] = case.run(swap)
        plain, swap_run = got[False][2], got[True][2]
        if plain.losses != swap_run.losses:
            raise RuntimeError(f"{case.schedule} {case.chunk_bytes}: swap changed the losses")
        walls.append((got[False][0], got[True][0]))
        cpus.append((got[False][1], got[True][1]))
        swapped = sum(rank.copies for rank in swap_run.ranks) // 2
        moved = sum(rank.offloaded_bytes for rank in swap_run.ranks)
    cpu_added = statistics.median(b - a for a, b in cpus)
    return {
        "backend": case.backend,
        "schedule": case.schedule,
        "chunk_bytes": case.chunk_bytes,
        "moved_per_chunk": moved // swapped if swapped else 0,
        "chunks_swapped": swapped,
        "step_plain_s": statistics.median(a for a, _ in walls),
        "step_swap_s": statistics.median(b for _, b in walls),
        "wall_ratio": statistics.median(b / a for a, b in walls),
        "cpu_ratio": statistics.median(b / a for a, b in cpus),
        "best_wall_ratio": min(b for _, b in walls) / min(a for a, _ in walls),
        "best_cpu_ratio": min(b for _, b in cpus) / min(a for a, _ in cpus),
        "cpu_added_per_chunk_s": cpu_added / swapped if swapped else 0.0,
        "pairs": pairs,
    }


PHASES = ("forward", "swap steps", "backward", "release")


def chunk_cost(backend_name: str, chunk_bytes: int, rounds: int, micro: int) -> dict[str, Any]:
    """The compute thread's CPU time per chunk (``time.thread_time``) of one stage on this
    thread, no runtime: a session of ``micro`` chunks without swap (its saved tensors
    counted, as a run without swap does) and one with every chunk swapped, alternating,
    ``rounds`` times; the copy jobs run between the timed phases (a pipeline runs them on
    its copy thread). Medians over rounds of the mean per chunk, by phase."""
    make = _mindspore_stage if backend_name == "mindspore" else _torch_stage
    module, _ = make(0)
    backend = backend_for(module)
    params = backend.trainable_parameters(module)
    state = module_state_tensors(module)
    tokens = chunk_bytes // BYTES_PER_TOKEN
    rng = np.random.default_rng(0)
    inputs = [
        backend.from_host(rng.standard_normal((tokens, WIDTH)).astype(np.float32))
        for _ in range(micro)
    ]
    seed = backend.from_host(np.ones((tokens, WIDTH), dtype=np.float32))
    engine = EmulatedDevice()
    generation = 0

    def session_of(swap: bool) -> dict[str, float]:
        nonlocal generation
        generation += 1
        totals = dict.fromkeys(PHASES, 0.0)
        session = PipelineSwapSession(
            SwapManager(backend),
            engine,
            rank=0,
            generation=generation,
            eligible={(0, m) for m in range(micro)} if swap else set(),
        )
        for index, x in enumerate(inputs):
            started = time.thread_time()
            with session.collection_context(0, index, protected=(x,), parameters=state):
                out, record = backend.autograd.record(module, (x,))
            lap = time.thread_time()
            totals["forward"] += lap - started
            if swap:
                session.protect_aliases(0, index, [out])
                for launch, finish in (
                    (session.prepare_offload, session.finish_offload),
                    (session.prepare_load, session.finish_load),
                ):
                    started = time.thread_time()
                    job = launch(0, index)
                    totals["swap steps"] += time.thread_time() - started
                    job.run()  # untimed: the copy thread's
                    started = time.thread_time()
                    finish(0, index)
                    totals["swap steps"] += time.thread_time() - started
            started = time.thread_time()
            backend.autograd.backward(record, seed, params)
            lap = time.thread_time()
            totals["backward"] += lap - started
            session.release_chunk(0, index)
            totals["release"] += time.thread_time() - lap
        session.close()
        return {phase: seconds / micro for phase, seconds in totals.items()}

    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with backend.run_scope():
        session_of(False)  # warm-up
        session_of(True)
        enabled = gc.isenabled()
        gc.disable()
        try:
            for index in range(rounds):
                for swap in (False, True) if index % 2 == 0 else (True, False):
                    results[swap].append(session_of(swap))
                gc.collect()
        finally:
            if enabled:
                gc.enable()
    medians = {
        swap: {p: statistics.median(r[p] for r in runs) for p in PHASES}
        for swap, runs in results.items()
    }
    totals = {
        swap: statistics.median(sum(r.values()) for r in runs) for swap, runs in results.items()
    }
    return {
        "plain_us": {p: 1e6 * v for p, v in medians[False].items()},
        "swap_us": {p: 1e6 * v for p, v in medians[True].items()},
        "chunk_plain_us": 1e6 * totals[False],
        "chunk_swap_us": 1e6 * totals[True],
        "chunk_ratio": statistics.median(
            sum(b.values()) / sum(a.values())
            for a, b in zip(results[False], results[True], strict=True)
        ),
    }


def sweep(
    backend: str, sizes: list[int], schedules: list[str], pairs: int, micro: int
) -> list[dict[str, Any]]:
    configure(backend)
    rows = []
    for size in sizes:
        chunk = chunk_cost(backend, size, rounds=max(5, pairs), micro=micro)
        for schedule in schedules:
            row = measure(Case(backend, schedule, size, micro), pairs)
            row.update(chunk)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def worker(args: argparse.Namespace, sizes: list[int], schedules: list[str]) -> None:
    rows = sweep(args.backend, sizes, schedules, args.pairs, args.micro)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out)


def run_backends(
    backends: list[str], sizes: str, schedules: str, pairs: int, micro: int
) -> list[dict[str, Any]]:
    """Each backend's sweep in a process of its own (its framework alone in it)."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ppswap-sweep-") as scratch:
        for backend in backends:
            out = Path(scratch) / f"{backend}.json"
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                f"--backend={backend}",
                f"--sizes={sizes}",
                f"--schedules={schedules}",
                f"--pairs={pairs}",
                f"--micro={micro}",
                f"--json={out}",
            ]
            proc = subprocess.run(command, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                tail = "\n".join(proc.stderr.strip().splitlines()[-10:])
                raise RuntimeError(f"the {backend} sweep failed:\n{tail}")
            rows.extend(json.loads(out.read_text()))
    return rows


def table(rows: list[dict[str, Any]], pairs: int, micro: int) -> str:
    """The sweep as markdown: a row per chunk size, backend and schedule."""
    lines = [
        "| chunk | backend | schedule | chunks swapped per step | step ms, no swap | "
        "step ms, swap | swap / no swap, wall | swap / no swap, CPU | best runs: wall | "
        "best runs: CPU | swap's CPU per chunk us |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {size_label(row['chunk_bytes'])} | {row['backend']} | {row['schedule']} | "
            f"{row['chunks_swapped']} | {1e3 * row['step_plain_s']:.1f} | "
            f"{1e3 * row['step_swap_s']:.1f} | {row['wall_ratio']:.2f}x | "
            f"{row['cpu_ratio']:.2f}x | {row['best_wall_ratio']:.2f}x | "
            f"{row['best_cpu_ratio']:.2f}x | {1e6 * row['cpu_added_per_chunk_s']:.0f} |"
        )
    lines += [
        "",
        "The compute thread alone, one stage, no runtime (CPU time per chunk, us):",
        "",
        "| chunk | backend | no swap | swap | swap / no swap | added: forward | swap steps "
        "| backward | release |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    seen = set()
    for row in rows:
        key = (row["chunk_bytes"], row["backend"])
        if key in seen:
            continue
        seen.add(key)
        plain, swap = row["plain_us"], row["swap_us"]
        added = " | ".join(f"{swap[p] - plain[p]:+.0f}" for p in PHASES)
        lines.append(
            f"| {size_label(row['chunk_bytes'])} | {row['backend']} | "
            f"{row['chunk_plain_us']:.0f} | {row['chunk_swap_us']:.0f} | "
            f"{row['chunk_ratio']:.2f}x | {added} |"
        )
    lines += [
        "",
        f"Stages of 8 swap_wrapper-ed blocks (linear 128 + tanh: 8 saved tensors moved per "
        f"chunk, each a storage of its own) and a linear layer; GPipe pp2, Interleaved 1F1B "
        f"pp2 vpp2, {micro} micro-batches, every rank in one process, copies unthrottled, "
        f"the gap plan. Medians of {pairs} pairs of runs, swap and no swap alternating: the "
        "step's wall time, the process's CPU time (every thread: compute, copies, event "
        "loop), and what swap adds to the process's CPU time per chunk swapped (the median "
        "pair's difference); best runs: the least time of each contender (other load only "
        "adds time). The compute thread alone: a session of the chunks without swap (saved "
        "tensors counted) and one with each chunk swapped, alternating, the copy jobs run "
        "untimed between the phases; medians over the sessions (at least 5) of the mean per "
        "chunk; swap / no swap: the median pair's ratio.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        choices=("mindspore", "torch"),
        default=None,
        help="run this backend's sweep here (default: each of --backends in a process)",
    )
    parser.add_argument("--backends", default="mindspore,torch")
    parser.add_argument("--sizes", default="64K,160K,1M,8M,64M")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    schedules = args.schedules.split(",")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        parser.error(f"--schedules: {unknown[0]!r} is not one of {', '.join(SCHEDULES)}")
    backends = args.backends.split(",")
    if any(b not in ("mindspore", "torch") for b in backends):
        parser.error(f"--backends: each one of mindspore, torch; got {args.backends!r}")
    if args.pairs < 1 or args.micro < 2 or args.micro % 2:
        parser.error(
            f"--pairs must be >= 1 and --micro an even number >= 2, got {args.pairs} and "
            f"{args.micro}"
        )
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError as exc:
        parser.error(f"--sizes: {exc}")
    if args.backend is not None:
        worker(args, sizes, schedules)
        return
    rows = run_backends(backends, args.sizes, args.schedules, args.pairs, args.micro)
    print(table(rows, args.pairs, args.micro))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out)


if __name__ == "__main__":
    main()
