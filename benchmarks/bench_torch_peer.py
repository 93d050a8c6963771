"""ppswap against torch.distributed.pipelining: step time and peak saved-activation bytes.

    python benchmarks/bench_torch_peer.py [--pp 2] [--model small|wide] [--rounds 15]
                                          [--warmup 2] [--quick] [--json PATH]
                                          [--swap-policy gap|peak] [--swap-min-bytes N]
                                          [--dtype float32|bfloat16] [--timeout-s 360]
                                          [--cores N]

The same per-stage torch model, batch, micro-batches and loss run one training step
(forward and backward of every micro-batch, no optimizer) per round under three
contenders, one process per pipeline rank over gloo, launched here with ``torchrun
--standalone --nproc_per_node PP`` (this script again, with ``--worker``):

- ``torch``: ``torch.distributed.pipelining`` (``PipelineStage`` per stage,
  ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``) on the default
  process group;
- ``ppswap``: ``run_schedule`` over ``TorchDistTransport`` (its own gloo group) without
  swap and with ``count_saved_bytes=False`` (no saved-tensor hooks: torch's timed steps
  count nothing either), every other option at its default (``p2p="plain"``);
- ``ppswap+swap``: the same with ``swap=True`` (every block ``swap_wrapper``-ed, the
  chunks of ``--swap-policy``: ``gap``, the default plan, or ``peak``, the fewest of the
  gap plan's chunks that give its peak; ``EmulatedDevice`` without throttling: host
  memory is the "device"): a rank that swaps counts every saved tensor (swap must), one
  the plan gives nothing to swap (1F1B at pp2 m8) runs without hooks.

Schedules: GPipe and 1F1B with ``PP`` stages, Interleaved 1F1B with ``2 PP`` (vpp 2),
``MICRO`` micro-batches each. The model: 8 pre-norm residual MLP blocks with a 4x hidden
layer, split evenly over the stages, 8 micro-batches of 8 sequences of 16 tokens, at one of
two widths (``--model``):

- ``small`` (width 128, the default): saved activations dominate the parameters (20 MiB
  against 2 MiB per rank under GPipe at pp2) and a step computes for about 60 ms per rank
  on this CPU. Each chunk saves 40 tensors (23 storages that swap moves) for about 8 ms of
  compute: swap's fixed cost per saved tensor (its Python on the compute thread) is at
  its largest share of a step here.
- ``wide`` (width 256): the same saved tensors, twice their bytes (40 MiB per rank under
  GPipe, against 8 MiB of parameters), four times the compute (about 250 ms per step).

``--dtype bfloat16``: the modules and the batch in bfloat16 (half the saved bytes; given
to ppswap as torch tensors, numpy has no bfloat16).

Every process uses one intra-op thread. ``--cores N``: the job runs on the first ``N``
logical CPUs this process may use only (the driver sets its own affinity before it
launches torchrun; every process and thread inherits it), so the same machine can be
measured with fewer cores, for instance ``--cores 1`` (both ranks on one core: the step
time is then the CPU work of both ranks) against the default, every one of them.

Step time: all ranks meet at a barrier, rank 0 starts its clock, every rank runs the step,
all meet at a barrier again and rank 0 stops its clock (the barrier's own cost falls on
every contender alike). After ``--warmup`` unmeasured rounds, ``--rounds`` rounds run
each contender once, in an order rotated round by round, so load drifts fall on all
three alike. Reported: the median step time per contender, the ratios of the medians
ppswap / torch, and the median of the per-round ratios (paired within a round). Targets
(issue 17): without swap <= 1.10x torch, with swap <= 1.15x. Beside it, each step's CPU
time (``time.process_time`` of the whole process, every thread, summed over the ranks)
and its main thread's share (``time.thread_time``): on a shared machine the wall clock
also counts the time a rank waited for a core, and the kernel shares the cores among
runnable *threads*, so under load the contender with more threads (ppswap: event loop,
compute thread, copy thread, the transport's waiting threads) gets a larger share of the
machine than a single-threaded one: the wall-clock ratio then flatters ppswap, the CPU
ratio does not.

Memory: peak saved-activation bytes per rank, counted the same way for both, ppswap's
in one more run of each that counts them (untimed, as torch's). ppswap's is
``RankStats.peak_saved_bytes``: the distinct device storages (whole storage size, each
counted once however many saved views it has) that the rank's live chunks hold for
backward, parameters and module state excluded; with swap, what is offloaded no longer
counts. torch's is counted by ``saved_tensors_hooks`` installed around each stage's
forward and the loss in one extra step after the timed rounds: a pack hook holds each
saved tensor's storage (parameters and buffers excluded) until autograd drops the packed
handle (after that micro-batch's backward), by storage, with the same rule; torch's
micro-batches are views of the whole batch, so a saved view of the batch counts by its
own extent, as ppswap's micro-batch (a copy) does. The
prediction is the planner's (``simulate.memory_rows`` of the policy's orders): the peak
resident chunks per rank without and with swap, converted to bytes with ppswap's measured
bytes per chunk (no-swap peak / no-swap peak chunks), as ``bench_memory.py`` does.

Where ppswap's step goes: per contender, the compute threads' time by job kind (forward,
backward with the chunk's release, the swap steps' prepare and finish), the copy threads'
busy time and the time the compute threads were blocked for a copy not done at its
SWAP_WAIT_*, from each run's ``RankStats`` (wall time on each thread), summed over the
ranks, median over rounds.

Also checked in every run: ppswap's per-micro-batch losses equal torch's (rtol 1e-6) and
swap on equals swap off bit for bit. ``--quick``: a smaller model, one warm-up round and
two measured rounds (checks the pipeline, not for publishing).

The model, its batch, the saved-bytes counter and torch's runner are in
``torch_peer_model.py``; the summary, the markdown and the headline in
``torch_peer_report.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_peer_model import MODELS, QUICK, Model, PeerRunner, build_modules, model_data, mse
from torch_peer_report import CONTENDERS, LOSS_RTOL, headline, markdown, summarize, thread_seconds

from ppswap.scheduler.config import ScheduleName
from ppswap.scheduler.cost import build_orders
from ppswap.scheduler.simulate import memory_rows
from ppswap.swap.manager import SWAP_MIN_BYTES

if TYPE_CHECKING:
    from ppswap.results import RunResult

__all__ = ["ROOT", "SCHEDULES", "launch", "main", "ppswap_source", "run_worker", "worker"]

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES: tuple[tuple[str, ScheduleName], ...] = (
    ("GPipe", "gpipe"),
    ("1F1B", "1f1b"),
    ("Interleaved vpp2", "interleaved_1f1b"),
)


# -- the worker: one pipeline rank under torchrun ------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    """One rank: every schedule, every contender, rounds; rank 0 writes the JSON."""
    import anyio

    return anyio.run(_worker, args)


async def _worker(args: argparse.Namespace) -> int:
    model = Model(**json.loads(args.model_json))

    async def measure(transport: Any) -> list[dict[str, Any]]:
        return [
            await _measure_schedule(name, schedule, model, transport, args)
            for name, schedule in SCHEDULES
        ]

    return await run_worker(measure, Path(args.out))


async def run_worker(measure: Callable[[Any], Awaitable[Any]], out: Path) -> int:
    """One torchrun worker: one intra-op thread, the default gloo group and a
    ``TorchDistTransport``; ``measure(transport)``'s result goes to ``out`` as JSON (rank
    0). A failure prints its traceback and aborts the whole job."""
    import torch
    import torch.distributed as dist

    from ppswap.backends.torch.distributed import TorchDistTransport

    torch.set_num_threads(1)
    # torch.distributed.pipelining needs the default group; the transport then uses it
    # (with a gloo group of its own for its tags) instead of initializing one itself.
    dist.init_process_group(backend="gloo")
    transport = TorchDistTransport()
    try:
        result = await measure(transport)
    except BaseException:
        import traceback

        traceback.print_exc()
        print(f"rank {transport.rank}: failed, aborting the job", flush=True)
        transport.abort(1)
    finally:
        transport.close()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    return 0


async def _measure_schedule(
    name: str, schedule: ScheduleName, model: Model, transport: Any, args: argparse.Namespace
) -> dict[str, Any]:
    import torch.distributed as dist

    from ppswap import PipelineStage, run_schedule
    from ppswap.scheduler.config import ScheduleConfig
    from ppswap.swap import EmulatedDevice

    rank, pp = transport.rank, transport.world_size
    vpp = 2 if schedule == "interleaved_1f1b" else 1
    stage_num = pp * vpp
    x, y = model_data(model)
    peer = PeerRunner(schedule, model, rank, pp, stage_num, (x, y))
    stages = [
        PipelineStage(m, s, stage_num)
        for s, m in enumerate(build_modules(model, stage_num, wrap=True))
        if s % pp == rank
    ]
    engines = {"ppswap": EmulatedDevice(), "ppswap+swap": EmulatedDevice()}
    # float32 as numpy arrays; bfloat16 as the tensors (numpy has no bfloat16)
    inputs, targets = (x.numpy(), y.numpy()) if model.dtype == "float32" else (x, y)

    async def run_ppswap(contender: str, count_saved_bytes: bool = False) -> RunResult:
        swap = contender == "ppswap+swap"
        return await run_schedule(
            stages,
            schedule,
            micro_batch_num=model.micro,
            inputs=inputs,
            targets=targets,
            loss_fn=mse,
            swap=swap,
            count_saved_bytes=count_saved_bytes,
            swap_min_bytes=args.swap_min_bytes,
            swap_policy=args.swap_policy,
            device=engines[contender],
            transport=transport,
            step_timeout=300,
        )

    times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    cpu: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    cpu_main: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    peaks: dict[str, list[int]] = {c: [] for c in CONTENDERS[1:]}
    threads: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS[1:]}
    losses: dict[str, list[float]] = {}
    offloaded: list[int] = []
    for round_index in range(args.warmup + args.rounds):
        shift = round_index % len(CONTENDERS)
        for contender in CONTENDERS[shift:] + CONTENDERS[:shift]:
            peer.zero_grad()
            for stage in stages:  # as an optimizer's zero_grad would: each run sets .grad
                stage.module.zero_grad(set_to_none=True)
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            main_started = time.thread_time()
            if contender == "torch":
                got = peer.step(x, y)
            else:
                result = await run_ppswap(contender)
                got = result.losses
            cpu_s = time.process_time() - cpu_started
            main_s = time.thread_time() - main_started
            dist.barrier()
            elapsed = time.perf_counter() - started
            losses[contender] = got
            if round_index < args.warmup:
                continue
            times[contender].append(elapsed)
            cpu[contender].append(cpu_s)
            cpu_main[contender].append(main_s)
            if contender != "torch":
                threads[contender].append(thread_seconds(result))
            if contender == "ppswap+swap":
                offloaded.append(result.ranks[rank].offloaded_bytes)
    # ppswap's saved bytes: one more run of each that counts them (not timed: the timed
    # runs count only what swap must, as torch's timed steps count nothing)
    for contender in CONTENDERS[1:]:
        dist.barrier()
        counted = await run_ppswap(contender, True)
        peaks[contender].append(counted.ranks[rank].peak_saved_bytes)
    # torch's saved bytes: one more step with the counter on (not timed)
    peer.zero_grad()
    peer.counter.enabled = True
    dist.barrier()
    peer.step(x, y)
    peer.counter.enabled = False
    if peer.counter.resident != 0:
        raise RuntimeError(f"rank {rank}: {peer.counter.resident} saved bytes left after a step")
    mine = {
        "rank": rank,
        "torch_peak": peer.counter.peak,
        "ppswap_peak": max(peaks["ppswap"]),
        "ppswap_peak_min": min(peaks["ppswap"]),
        "swap_peak": max(peaks["ppswap+swap"]),
        "swap_peak_min": min(peaks["ppswap+swap"]),
        "offloaded": max(offloaded),
        "losses": losses,
        "cpu_s": cpu,
        "cpu_main_s": cpu_main,
    }
    every: list[dict[str, Any]] = [{} for _ in range(pp)]
    dist.all_gather_object(every, mine)
    config = ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=model.micro, swap=True)
    table = memory_rows(build_orders(config, args.swap_policy))
    ranks = []
    for got_rank, prediction in zip(every, table, strict=True):
        chunks_no_swap = prediction["peak_chunks_no_swap"]
        chunk_bytes = got_rank["ppswap_peak"] / chunks_no_swap if chunks_no_swap else 0.0
        ranks.append(
            {
                **{k: v for k, v in got_rank.items() if k not in ("losses", "cpu_s", "cpu_main_s")},
                "eligible": prediction["eligible"],
                "chunks_no_swap": chunks_no_swap,
                "chunks_swap": prediction["peak_chunks_swap"],
                "chunk_bytes": chunk_bytes,
                "predicted_swap": prediction["peak_chunks_swap"] * chunk_bytes,
            }
        )
    last = every[-1]["losses"]  # the last rank holds the last stage under both
    return {
        "schedule": name,
        "pp": pp,
        "vpp": vpp,
        "times_s": times,
        "cpu_s": {  # per round, summed over the ranks
            c: [sum(r["cpu_s"][c][i] for r in every) for i in range(args.rounds)]
            for c in CONTENDERS
        },
        "cpu_main_s": {  # the main thread alone (ppswap: the event loop), summed likewise
            c: [sum(r["cpu_main_s"][c][i] for r in every) for i in range(args.rounds)]
            for c in CONTENDERS
        },
        "thread_s": threads,  # per round, from the run's stats of every rank
        "losses_equal": bool(
            len(last["torch"]) == model.micro
            and all(
                abs(a - b) <= LOSS_RTOL * abs(a)
                for a, b in zip(last["torch"], last["ppswap"], strict=True)
            )
        ),
        "losses_bit_identical": last["torch"] == last["ppswap"],
        "swap_bit_identical": last["ppswap"] == last["ppswap+swap"],
        "ranks": ranks,
    }


# -- the driver: launch, collect, report ---------------------------------------------------------


def launch(
    script: Path, worker_args: Sequence[str], nproc: int, timeout_s: float, out: Path
) -> None:
    """``torchrun --standalone --nproc_per_node NPROC script --worker --out OUT
    *worker_args`` (the workers write ``out``); the whole process group is killed at the
    deadline."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(script),
        "--worker",
        "--out",
        str(out),
        *worker_args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise SystemExit(f"torchrun did not finish within {timeout_s} s:\n{output}") from None
    if process.returncode != 0 or not out.exists():
        raise SystemExit(f"torchrun exited with status {process.returncode}:\n{output}")


def ppswap_source() -> str:
    """The ppswap measured: the commit of the repository it was imported from, and whether
    its ``ppswap/`` had uncommitted changes."""
    import ppswap

    where = Path(ppswap.__file__).resolve().parent.parent

    def git(*args: str) -> str:
        command = ["git", "-C", str(where), *args]
        return subprocess.run(command, capture_output=True, text=True, check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "ppswap")
    place = "" if where == ROOT else f" (imported from {where})"
    return f"{commit}{', with uncommitted changes in ppswap/' if dirty else ''}{place}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (15)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured rounds (2)")
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="small", help="the model (small)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 + 2 rounds")
    parser.add_argument(
        "--swap-min-bytes",
        type=int,
        default=SWAP_MIN_BYTES,
        help=f"ppswap's swap_min_bytes ({SWAP_MIN_BYTES}, its default): smaller storages "
        "stay on device",
    )
    parser.add_argument(
        "--swap-policy",
        choices=("gap", "peak"),
        default="gap",
        help='ppswap\'s swap_policy ("gap", its default: every chunk the gap rule admits; '
        '"peak": the fewest of those that give the same peak)',
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the modules' and the batch's dtype (float32)",
    )
    parser.add_argument(
        "--cores",
        type=int,
        default=None,
        help="run the job on the first N logical CPUs this process may use (all of them)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=360.0,
        help="kill the torchrun job (its whole process group) after this long",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.swap_min_bytes < 0:
        parser.error(f"--swap-min-bytes must be >= 0, got {args.swap_min_bytes}")
    if args.pp < 2:
        parser.error(f"--pp must be >= 2, got {args.pp}")
    model = replace(QUICK if args.quick else MODELS[args.model], dtype=args.dtype)
    if model.blocks % (2 * args.pp):
        parser.error(f"--pp {args.pp}: {model.blocks} blocks do not split over {2 * args.pp}")
    if args.cores is not None:
        allowed = sorted(os.sched_getaffinity(0))
        if not 1 <= args.cores <= len(allowed):
            parser.error(
                f"--cores must be in 1..{len(allowed)} (the CPUs this process may use: "
                f"{allowed}), got {args.cores}"
            )
        os.sched_setaffinity(0, allowed[: args.cores])
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 15)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ppswap-peer-") as scratch:
        out = Path(scratch) / "results.json"
        worker_args = ["--model-json", json.dumps(asdict(model))]
        worker_args += ["--rounds", str(args.rounds), "--warmup", str(args.warmup)]
        worker_args += ["--swap-min-bytes", str(args.swap_min_bytes)]
        worker_args += ["--swap-policy", args.swap_policy]
        launch(Path(__file__).resolve(), worker_args, args.pp, args.timeout_s, out)
        results = json.loads(out.read_text())
    from importlib import metadata

    report = {
        "pp": args.pp,
        "model": asdict(model),
        "model_name": "quick" if args.quick else args.model,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "quick": args.quick,
        "swap_min_bytes": args.swap_min_bytes,
        "swap_policy": args.swap_policy,
        "torch": metadata.version("torch"),
        "cores": len(os.sched_getaffinity(0)),
        "cpus": sorted(os.sched_getaffinity(0)),
        "cores_given": args.cores,
        "ppswap": ppswap_source(),
        "load_before": ", ".join(f"{v:.2f}" for v in load_before),
        "load_after": ", ".join(f"{v:.2f}" for v in os.getloadavg()),
        "summary": summarize(results),
        "results": results,
    }
    report["headline"] = headline(report)
    print(markdown(report))
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    bad = [r["schedule"] for r in results if not r["losses_equal"] or not r["swap_bit_identical"]]
    if bad:
        print(f"losses differ: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
