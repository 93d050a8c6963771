"""Run every benchmark and write ``docs/benchmarks.md`` (the ``make bench`` target).

    make bench                                   # = .venv/bin/python benchmarks/run_all.py
    python benchmarks/run_all.py [--quick] [--only NAME ...] [--output PATH]

Each benchmark runs as its own process (its own MindSpore context, its own time limit);
its standard output (markdown) becomes one section of the document, with its command and
wall time. A benchmark that fails or outruns its limit leaves a note with the end of its
error output instead of a table; the others still run. The document starts with the
machine (CPU, cores, memory, load average before and after), the software versions, the
commit, and a headline table assembled from the memory and cost benchmarks' JSON output
(and the torch peer benchmark's one-line comparison from its JSON), so every figure it
quotes comes from this command. ``--quick`` runs shorter variants (for
checking the pipeline, not for publishing). The whole run takes about 13 minutes on the
2-core development machine, 5 of them the soak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
DEFAULT_OUTPUT = ROOT / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Benchmark:
    """One benchmark script: its section title, arguments and time limit."""

    name: str
    script: str
    title: str
    about: str
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()
    limit_s: float = 300.0
    json_out: bool = False  # pass ``--json FILE`` and keep the numbers for the headline


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "memory",
        "bench_memory.py",
        "Memory: what swap saves",
        "Measured peak saved-activation bytes per rank without and with swap (the demo LM, "
        "every block wrapped with `swap_wrapper`, no throttling), beside the planner's "
        "prediction in chunks converted to bytes, on every schedule family: GPipe, 1F1B, "
        "Interleaved 1F1B and torch.distributed.pipelining's Looped BFS, Interleaved Zero "
        "Bubble, ZBV and DualPipeV. The residue is what swap cannot move: "
        "bytes pinned on device because they alias the stage input, a received buffer, the "
        "output handed to the next stage or the loss, and tensors saved outside the wrapped "
        "blocks (embedding, final norm, head, loss).",
        limit_s=300.0,
        json_out=True,
    ),
    Benchmark(
        "memory-torch",
        "bench_memory.py",
        "Memory: what swap saves, on torch",
        "The table above with the torch demo LM (the same sizes and schedules). A backward "
        "split into BWD_INPUT and BWD_WEIGHT keeps its chunk's saved tensors on torch until "
        "its BWD_WEIGHT (the dw pass reads them; a swapped chunk loaded back for BWD_INPUT "
        "stays until then), and the prediction releases them there (`Backend.saved_until`; "
        "MindSpore releases them at BWD_INPUT): where an order defers its weights "
        "(Interleaved Zero Bubble, ZBV), torch holds more than MindSpore, and swap plans "
        "and cuts less.",
        args=("--backend", "torch"),
        limit_s=300.0,
    ),
    Benchmark(
        "cost",
        "bench_cost.py",
        "Cost: step time and exposed copy wait",
        "Step time, exposed copy wait and hidden copy share with copies throttled to half a "
        "compute slot per chunk, 2x and 4x that; the fixed gap rule against the cost-aware "
        'policy (`swap_policy="cost"`, budget 2% of the step, headroom 0.5: the '
        "prediction may use 1%). 'predicted' is the cost model's exposed wait for the same "
        "plan; each row is the median of 3 runs.",
        args=("--repeats", "3"),
        quick_args=("--repeats", "1", "--calibration-repeats", "1"),
        limit_s=480.0,
        json_out=True,
    ),
    Benchmark(
        "scale",
        "bench_scale.py",
        "Scale on paper",
        "What `ppswap plan --swap` predicts for pp up to 64, vpp up to 4 and micro up to "
        "1024 (peak resident chunks, bubble share) and how long planning takes.",
        quick_args=("--quick",),
        limit_s=300.0,
        json_out=True,
    ),
    Benchmark(
        "budget",
        "bench_budget.py",
        "Memory budget: keep, swap or recompute per chunk",
        "memory_budget on the demo LM (MindSpore and torch) and the torch peer model (pp2, "
        "every block wrapped by recompute_wrapper and swap_wrapper, one process per workload, "
        "one intra-op thread; policies interleaved, medians), GPipe, 1F1B, Interleaved, 1F1B + "
        "overlap, copies throttled fast (a tenth of a forward per chunk) and slow (two "
        "forwards); budgets of 75% and 50% of the keep-everything peak and "
        "recompute-everything's peak: violations, peak cut, share of chunks moved or "
        "recomputed, predicted over measured peak and step, step over the best simple policy "
        "that fits (keep, gap-rule swap, recompute all) and over recompute-all; planning time "
        "of Interleaved pp8 vpp2 m64.",
        args=("--quick", "--repeats", "2"),
        quick_args=("--quick", "--repeats", "1", "--backend", "torch"),
        limit_s=480.0,
    ),
    Benchmark(
        "memory-model",
        "memory_model_table.py",
        "Memory model per rank (pp4, m8)",
        "The planner's predicted resident chunks per rank (the source of `docs/memory-model.md`).",
        limit_s=60.0,
    ),
    Benchmark(
        "plan",
        "bench_plan.py",
        "Planner time",
        "Lowering time of every rank of interleaved pp32 vpp4 m256 and of ZBV pp32 m256 with "
        "FSDP, batch P2P and swap, beside torch.distributed.pipelining's schedule "
        "construction for the same config; growth in micro; the cost-aware policy's "
        "planning time.",
        args=("--repeats", "3"),
        quick_args=("--repeats", "1"),
        limit_s=180.0,
    ),
    Benchmark(
        "swap-check",
        "bench_swap_check.py",
        "In-place checks: what each swap_check mode costs",
        "The compute thread's CPU time for swap (capture, seal, prepare, finish, release) "
        'per chunk with `swap_check="sampled"` (the default) and `"full"`, against no swap, '
        "on one stage of the demo LM.",
        quick_args=("--chunks", "8", "--repeats", "1"),
        limit_s=180.0,
    ),
    Benchmark(
        "swap-overhead",
        "bench_swap_overhead.py",
        "Swap's own Python per chunk (torch, compute stripped)",
        "One stage of the torch peer model at width 16 (the same 23 storages saved per "
        "chunk, each leaf computing for microseconds): what swap adds per chunk and per "
        "storage moved, by phase, with the garbage collector off while timed. The steady "
        "figure for changes to the swap layer's hot path.",
        quick_args=("--sessions", "5", "--repeats", "2"),
        limit_s=120.0,
    ),
    Benchmark(
        "swap-overhead-sweep",
        "bench_swap_overhead.py",
        "Swap's step cost by chunk size (MindSpore and torch, one process)",
        "A pipeline step with swap over the same step without, at chunks of 64 KB to 64 MB "
        "held in 8 saved tensors (the compute per chunk grows with its bytes), GPipe pp2 "
        "and Interleaved 1F1B pp2 vpp2 m8, copies unthrottled; swap and no-swap runs "
        "alternating. The target: at most 1.10x from 160 KB up.",
        args=("--sweep", "--pairs", "3"),
        quick_args=("--sweep", "--sizes", "64K,1M", "--pairs", "1", "--micro", "4"),
        limit_s=1800.0,
    ),
    Benchmark(
        "runtime",
        "bench_runtime.py",
        "Orchestration cost of the actor runtime",
        "Overhead per MetaStep of the actors against a synchronous loop over the same "
        "orders, and event-loop lag while training.",
        args=("--repeats", "9"),
        quick_args=("--repeats", "1"),
        limit_s=180.0,
    ),
    Benchmark(
        "p2p",
        "bench_p2p.py",
        "P2P transport (MPI, 2 processes)",
        "`MPITransport` against mpi4py's own ping-pong (needs the venv's `mpiexec`).",
        quick_args=("--rounds", "2", "--max-mib", "4"),
        limit_s=120.0,
    ),
    Benchmark(
        "cma_alignment",
        "bench_cma_alignment.py",
        "Single-copy transfers and page offsets (MPI, 2 processes)",
        "Why `MPITransport` receives each body at the page offset of the sender's buffer: "
        "blocking mpi4py with one direction's destination `d` bytes further into its page "
        "than the source, as a ratio to `d = 0`.",
        quick_args=("--rounds", "2", "--sizes-mib", "1"),
        limit_s=120.0,
    ),
    Benchmark(
        "soak",
        "bench_soak.py",
        "Soak: RSS growth per run, ppswap beside the framework",
        "576 pipeline runs (1F1B pp4 m8, a 4-block width-64 MLP; swap on and swap off, each "
        "cycling ok, failed, ok, cancelled) beside a plain `mindspore.value_and_grad` loop "
        "over the unsplit model, in interleaved blocks in one process: each series' RSS "
        "growth per run (least-squares slope, median block rate, per kind of run) and the "
        "pipeline's minus the baseline's, what ppswap adds. Curves: "
        "`docs/diagrams/soak_rss.png`.",
        args=(
            "--runs=576",
            "--block=48",
            "--settle=8",
            "--quiet",
            "--plot=docs/diagrams/soak_rss.png",
        ),
        quick_args=("--runs=96", "--block=16", "--settle=4", "--quiet"),
        limit_s=2400.0,
    ),
    Benchmark(
        "torch-peer",
        "bench_torch_peer.py",
        "Against torch.distributed.pipelining (pp2, gloo, one process per rank)",
        "The same torch model, batch, micro-batches and loss under torch.distributed."
        "pipelining (`PipelineStage` with `ScheduleGPipe`, `Schedule1F1B`, "
        "`ScheduleInterleaved1F1B`) and under ppswap over `TorchDistTransport`, swap off "
        "and on, in one torchrun job, the contenders alternating round by round: median "
        "step time and the ratios ppswap / torch (targets: 1.10x without swap, 1.15x with), "
        "and peak saved-activation bytes per rank counted the same way for both, beside the "
        "planner's predicted cut.",
        quick_args=("--quick",),
        limit_s=420.0,
        json_out=True,
    ),
    Benchmark(
        "torch-peer-wide",
        "bench_torch_peer.py",
        "Against torch.distributed.pipelining, the wide model (width 256)",
        "The comparison above on the same blocks at twice the width: the same saved "
        "tensors per chunk with twice their bytes and four times the compute, so swap's "
        "fixed cost per saved tensor is a quarter of the share it has above.",
        args=("--model", "wide", "--rounds", "11"),
        quick_args=("--model", "wide", "--rounds", "2", "--warmup", "1"),
        limit_s=420.0,
        json_out=True,
    ),
    Benchmark(
        "torch-peer-peak",
        "bench_torch_peer.py",
        'Against torch.distributed.pipelining, swap_policy="peak" (the small model)',
        "The first comparison with ppswap's peak policy: per rank the fewest of the gap "
        "plan's chunks that give the gap plan's peak (GPipe pp2 m8: 6 of 8 per rank, "
        "Interleaved: 8 of 14 on rank 0), so the same predicted cut with fewer copies.",
        args=("--swap-policy", "peak"),
        quick_args=("--quick", "--swap-policy", "peak"),
        limit_s=420.0,
        json_out=True,
    ),
    Benchmark(
        "torch-peer-bf16",
        "bench_torch_peer.py",
        "Against torch.distributed.pipelining in bfloat16 (the small model)",
        "The first comparison with the modules and the batch in bfloat16: half the saved "
        "bytes, the same saved tensors per chunk (so the same Python per chunk for swap), "
        "and torch's bfloat16 kernels on this CPU.",
        args=("--dtype", "bfloat16"),
        quick_args=("--quick", "--dtype", "bfloat16"),
        limit_s=420.0,
        json_out=True,
    ),
    Benchmark(
        "torch-peer-one-core",
        "bench_torch_peer.py",
        "Against torch.distributed.pipelining on one core (the small model)",
        "The first comparison with the whole job held to one core (`--cores 1`): the two "
        "ranks' work then runs one after the other, so the step-time ratio is the ratio of "
        "the work each contender does, without the cost of ppswap's extra threads on cores "
        'where each rank has one (`docs/torch_dist.md`, "Cores per rank").',
        args=("--cores", "1"),
        quick_args=("--quick", "--cores", "1"),
        limit_s=600.0,
        json_out=True,
    ),
    Benchmark(
        "torch-overhead",
        "bench_torch_overhead.py",
        "Against torch.distributed.pipelining without compute: per micro-batch and per step",
        "A width-8 model (each leaf computes for tens of microseconds), 1F1B pp2 over gloo, "
        "2 and 16 micro-batches, torch.distributed.pipelining and ppswap (no swap) "
        "alternating: a straight line through each one's median step times splits it into "
        "a cost per micro-batch (two messages and two leaves per rank) and a fixed cost per "
        "step, what the runtime adds beyond the compute.",
        quick_args=("--rounds", "5", "--warmup", "2"),
        limit_s=300.0,
    ),
    Benchmark(
        "moe",
        "bench_moe.py",
        "Expert parallelism: exposed all-to-all with and without overlap_b_f",
        "A MoE stage per rank (width 64, 4 experts, top-2), pp2 x dp2 with the experts "
        "split over ep=2, one process per rank under torchrun (gloo), 1F1B m8. A fixed "
        "delay is injected before every all-to-all so that the exchange's latency shows on "
        "a CPU host; the exposed all-to-all time is the step with the delay minus the step "
        "without it, as a share of the step, without and with overlap_b_f (the goal: under "
        "10% with it, 30% or more without). The last row is EP=1: every expert on every "
        "rank, no all-to-all.",
        args=("--rounds", "3"),
        limit_s=600.0,
    ),
    Benchmark(
        "serve",
        "bench_serve.py",
        "ppswap serve under load while training",
        "A `ppswap serve` process on 127.0.0.1 trains the torch demo LM (pp2, m8, swap, SGD "
        "with momentum), each job twice: quiet, then while 100 concurrent clients ask for "
        "its status (`GET /runs/{id}`) and the metrics (`GET /metrics`) in turn, polling "
        "once a second each or back to back, bounded in requests and seconds. Response "
        "times are measured on the client, which shares the cores with the server and its "
        "training; the target is a p99 under 50 ms, and the loaded run's losses equal the "
        "quiet run's bit for bit. The control row is the same polling against the idle "
        "server: what the machine itself allows at that moment. Back to back keeps 100 "
        "requests in flight at all times: its times are the queue behind a server that "
        "shares two cores with its training (a throughput limit, not a latency).",
        quick_args=("--quick",),
        limit_s=600.0,
        json_out=True,
    ),
)


@dataclass
class Outcome:
    """What one benchmark produced."""

    bench: Benchmark
    command: str
    wall_s: float
    markdown: str
    error: str | None
    data: Any = None


def run_benchmark(bench: Benchmark, quick: bool, scratch: Path) -> Outcome:
    """Run one benchmark script as a subprocess within its time limit."""
    script = BENCH / bench.script
    args = list(bench.quick_args if quick and bench.quick_args else bench.args)
    shown = " ".join(["python", f"benchmarks/{bench.script}", *args])
    json_path = scratch / f"{bench.name}.json"
    if bench.json_out:
        args += ["--json", str(json_path)]
    if not script.exists():
        return Outcome(bench, shown, 0.0, "", f"{script.name} is not in benchmarks/ yet")
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(script), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=bench.limit_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        tail = exc.stderr if isinstance(exc.stderr, str) else ""
        return Outcome(
            bench,
            shown,
            time.perf_counter() - started,
            "",
            f"did not finish within its limit of {bench.limit_s:.0f} s; not included."
            + (f"\n\n```\n{_tail(tail)}\n```" if tail else ""),
        )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return Outcome(
            bench,
            shown,
            wall,
            proc.stdout,
            f"exited with status {proc.returncode}:\n\n```\n{_tail(proc.stderr)}\n```",
        )
    data = json.loads(json_path.read_text()) if bench.json_out and json_path.exists() else None
    return Outcome(bench, shown, wall, proc.stdout, None, data)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return proc.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{commit}{' (with uncommitted changes)' if dirty else ''}"


def machine_section(
    load_before: tuple[float, ...], load_after: tuple[float, ...], commit: str
) -> str:
    loads = ", ".join(f"{v:.2f}" for v in load_before)
    loads_after = ", ".join(f"{v:.2f}" for v in load_after)
    return "\n".join(
        [
            "| | |",
            "|---|---|",
            f"| CPU | {_cpu_model()}, {os.cpu_count()} logical cores |",
            f"| memory | {_memory_gib()} |",
            f"| OS | {platform.platform()} |",
            f"| Python | {platform.python_version()} |",
            f"| mindspore / torch / numpy / anyio | {_version('mindspore')} / "
            f"{_version('torch')} / {_version('numpy')} / {_version('anyio')} |",
            f"| ppswap commit | {commit} |",
            f"| load average (1, 5, 15 min) | before: {loads}; after: {loads_after} |",
            "| MindSpore mode | PyNative on CPU; ppswap runs synchronous dispatch for the "
            "duration of a run (`MindSporeBackend.run_scope`, docs/architecture.md) |",
        ]
    )


def headline(outcomes: Sequence[Outcome]) -> str:
    """Memory reduction and the cost at half-slot copies, one row per schedule."""
    by_name = {o.bench.name: o for o in outcomes}
    memory = by_name.get("memory")
    cost = by_name.get("cost")
    if memory is None or memory.data is None:
        return "(the memory benchmark did not run: no headline)"
    rows: dict[str, dict[str, Any]] = {}
    for row in memory.data:
        entry = rows.setdefault(row["schedule"], {"before": 0, "after": 0})
        entry["before"] = max(entry["before"], row["peak_no_swap"])
        entry["after"] = max(entry["after"], row["peak_swap"])
    cost_rows = cost.data["rows"] if cost is not None and cost.data is not None else []
    lines = [
        "| schedule | peak saved MiB, no swap | with swap | reduction "
        "| step time with swap / without (copies unthrottled) | exposed wait, half-slot "
        "copies | copy time hidden, half-slot copies |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, entry in rows.items():
        base = next(
            (r for r in cost_rows if r["schedule"] == name and r["policy"] == "no swap"), None
        )
        swapped = {
            r["copy_slots"]: r for r in cost_rows if r["schedule"] == name and r["policy"] == "gap"
        }
        half, free = swapped.get(0.5), swapped.get(0.0)
        ratio = f"{free['step_s'] / base['step_s']:.2f}" if free and base else "-"
        exposed = f"{100 * half['exposed_share']:.1f}%" if half else "-"
        hidden = f"{100 * half['hidden_share']:.1f}%" if half and half["hidden_share"] else "-"
        cut = 100 * (entry["before"] - entry["after"]) / entry["before"] if entry["before"] else 0
        lines.append(
            f"| {name} | {entry['before'] / 2**20:.1f} | {entry['after'] / 2**20:.1f} | "
            f"{cut:.0f}% | {ratio} | {exposed} | {hidden} |"
        )
    return "\n".join(lines)


def peer_headline(outcomes: Sequence[Outcome]) -> str:
    """The torch peer benchmarks' lines (their JSON's ``headline``), those that ran."""
    lines = [
        str(o.data["headline"])
        for o in outcomes
        if o.bench.name.startswith("torch-peer") and o.data is not None
    ]
    return "\n\n".join(lines) if lines else "(the torch peer benchmark did not run)"


def render(outcomes: Sequence[Outcome], machine: str, total_s: float, quick: bool) -> str:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "# Benchmarks",
        "",
        f"Generated by `make bench` (`python benchmarks/run_all.py{' --quick' if quick else ''}`)"
        f" on {now}, in {total_s / 60:.1f} minutes. Do not edit by hand: rerun the command.",
        "",
        "## Machine",
        "",
        machine,
        "",
        "Timings on this machine are noisy: it has two cores and other work may run beside "
        "the benchmarks (see the load average). Memory figures are exact and repeatable "
        "(except with overlap_b_f, where the two leaves of a composite may run in either "
        "order).",
        "",
        "## Headline",
        "",
        "Largest rank per schedule (pp4, m8, the default plan). 'Exposed wait' is the worst "
        "rank's time blocked in SWAP_WAIT_*, as a share of the step, with copies throttled "
        "to half a compute slot per chunk; the step-time ratio is swap with unthrottled "
        "copies against no swap, medians of 5 runs each, alternating (what swap's own work "
        "costs here: capture hooks, the swap steps on the compute thread, copy threads "
        "sharing two cores; single steps of one configuration vary by about 10% from one to "
        "the next on this machine). Details in the sections below.",
        "",
        headline(outcomes),
        "",
        peer_headline(outcomes),
        "",
    ]
    for outcome in outcomes:
        parts += [
            f"## {outcome.bench.title}",
            "",
            outcome.bench.about,
            "",
            f"Command: `{outcome.command}` ({outcome.wall_s:.0f} s)",
            "",
        ]
        if outcome.markdown.strip():
            parts += [outcome.markdown.strip(), ""]
        if outcome.error is not None:
            parts += [f"**Not complete**: {outcome.error}", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, for checking")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[b.name for b in BENCHMARKS],
        default=None,
        help="run only these benchmarks",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHMARKS if args.only is None or b.name in args.only]
    load_before = os.getloadavg()
    commit = _commit()  # before the benchmarks write their own files (the soak's plot)
    started = time.perf_counter()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="ppswap-bench-") as scratch:
        for bench in chosen:
            print(f"[bench] {bench.name}: {bench.script} ...", flush=True)
            outcome = run_benchmark(bench, args.quick, Path(scratch))
            status = "ok" if outcome.error is None else "NOT COMPLETE"
            print(f"[bench] {bench.name}: {status} in {outcome.wall_s:.0f} s", flush=True)
            outcomes.append(outcome)
    total = time.perf_counter() - started
    machine = machine_section(load_before, os.getloadavg(), commit)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(outcomes, machine, total, args.quick))
    print(f"[bench] wrote {args.output} ({total:.0f} s)")
    return 0 if all(o.error is None for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
