"""The report of ``bench_torch_peer.py``: its workers' results summarized and written out.

``summarize`` turns the workers' per-schedule results into medians and ratios,
``markdown`` writes the tables the script prints, ``headline`` the one line that
``run_all.py`` quotes. ``thread_seconds`` splits one ppswap run's thread time into
``THREAD_PARTS`` (the workers record it per round). ``CONTENDERS`` names the contenders
in the results and the report, ``TARGETS`` their step-time targets over torch and
``LOSS_RTOL`` the tolerance of the loss comparison.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from ppswap.swap.manager import SWAP_MIN_BYTES

if TYPE_CHECKING:
    from ppswap.results import RunResult

__all__ = [
    "CONTENDERS",
    "LOSS_RTOL",
    "TARGETS",
    "THREAD_PARTS",
    "headline",
    "markdown",
    "summarize",
    "thread_seconds",
]

CONTENDERS = ("torch", "ppswap", "ppswap+swap")
TARGETS = {"ppswap": 1.10, "ppswap+swap": 1.15}
LOSS_RTOL = 1e-6


THREAD_PARTS = (
    "forward",
    "backward",
    "recompute",
    "swap_prepare",
    "swap_finish",
    "copy",
    "exposed_wait",
)
"""What ``thread_seconds`` splits a ppswap step into: compute-thread time by job kind
(``backward`` includes ``backward_input`` and ``backward_weight``), the copy threads'
busy time and the compute threads' time blocked in a SWAP_WAIT_* for a copy not done."""


def thread_seconds(result: RunResult) -> dict[str, float]:
    """Seconds of one run on the compute threads by job kind and on the copy threads
    (wall time on each thread, as the runtime times them), summed over every rank."""
    parts = dict.fromkeys(THREAD_PARTS, 0.0)
    for stats in result.ranks:
        for kind, seconds in stats.compute_job_s.items():
            parts["backward" if kind.startswith("backward") else kind] += seconds
        parts["copy"] += stats.copy_busy_s
        parts["exposed_wait"] += stats.exposed_copy_wait_s
    return parts


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per schedule: median step time per contender, ratios of medians, paired ratios."""
    rows = []
    for result in results:
        times, cpu = result["times_s"], result["cpu_s"]
        medians = {c: statistics.median(times[c]) for c in CONTENDERS}
        cpu_medians = {c: statistics.median(cpu[c]) for c in CONTENDERS}
        main_medians = {c: statistics.median(result["cpu_main_s"][c]) for c in CONTENDERS}
        row: dict[str, Any] = {
            "schedule": result["schedule"],
            "median_s": medians,
            "cpu_median_s": cpu_medians,
            "cpu_main_median_s": main_medians,
            "thread_median_s": {
                c: {p: statistics.median(r[p] for r in runs) for p in THREAD_PARTS}
                for c, runs in result["thread_s"].items()
            },
        }
        for contender in CONTENDERS[1:]:
            paired = [a / b for a, b in zip(times[contender], times["torch"], strict=True)]
            row[f"{contender}/torch"] = medians[contender] / medians["torch"]
            row[f"{contender}/torch paired"] = statistics.median(paired)
            row[f"{contender}/torch cpu"] = cpu_medians[contender] / cpu_medians["torch"]
        rows.append(row)
    return rows


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def _cut(before: float, after: float) -> str:
    return f"{100 * (before - after) / before:.0f}%" if before else "-"


def _verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "FAIL"


def markdown(report: dict[str, Any]) -> str:
    model, rows, results = report["model"], report["summary"], report["results"]
    params_per_block = 2 * model["dim"] * 4 * model["dim"] + 7 * model["dim"]
    dtype = model.get("dtype", "float32")
    itemsize = 2 if dtype == "bfloat16" else 4
    kept = report.get("swap_min_bytes", SWAP_MIN_BYTES)
    policy = report.get("swap_policy", "gap")
    min_bytes = "" if kept == SWAP_MIN_BYTES else f", swap_min_bytes={kept}"
    lines = [
        f"pp{report['pp']}, one process per rank, gloo; {model['blocks']} blocks of width "
        f"{model['dim']} (hidden {4 * model['dim']}, "
        f"{params_per_block * itemsize / 2**20:.2f} MiB of parameters each) in {dtype}, "
        f"split evenly over the stages; {model['micro']} micro-batches "
        f"of {model['micro_batch']} x {model['seq']} tokens; ppswap with its default "
        f'options but where named (p2p plain, swap_policy "{policy}"{min_bytes}); '
        f"warm-up rounds: {report['warmup']}, measured rounds: {report['rounds']}, "
        f"the contenders alternating; torch {report['torch']}; ppswap {report['ppswap']}.",
        "",
        f"Load average (1, 5, 15 min) before: {report['load_before']}; after: "
        f"{report['load_after']}, on {_cores(report)}. The {report['pp']} "
        "ranks, ppswap's compute, copy and transport threads and whatever else runs on the "
        "machine share those cores, so the wall clock also counts time spent waiting for "
        "one; with the load above the core count, read the wall-clock ratios with the CPU "
        "times below.",
        "",
        "Step time (median over rounds) and ppswap / torch (ratio of the medians; in "
        "brackets the median of the per-round ratios):",
        "",
        "| schedule | torch ms | ppswap ms | ppswap+swap ms | ppswap / torch (target 1.10) "
        "| ppswap+swap / torch (target 1.15) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        medians = row["median_s"]
        cells = []
        for contender in CONTENDERS[1:]:
            ratio, paired = row[f"{contender}/torch"], row[f"{contender}/torch paired"]
            verdict = _verdict(ratio, TARGETS[contender])
            cells.append(f"{ratio:.2f}x ({paired:.2f}x) {verdict}")
        lines.append(
            f"| {row['schedule']} pp{report['pp']} m{model['micro']} | "
            f"{1e3 * medians['torch']:.1f} | {1e3 * medians['ppswap']:.1f} | "
            f"{1e3 * medians['ppswap+swap']:.1f} | {' | '.join(cells)} |"
        )
    lines += [
        "",
        "CPU time per step (process CPU time of every thread, summed over the ranks; "
        "median over rounds): what each contender computes, less sensitive to other load "
        "than the wall clock. In brackets the main thread's share: torch runs everything "
        "there (compute, its schedule, posting P2P); ppswap's main thread is the event loop "
        "(actors, transport calls), its compute runs on the compute thread and the rest on "
        "the transport's waiting threads and the copy thread:",
        "",
        "| schedule | torch CPU ms | ppswap CPU ms | ppswap+swap CPU ms | ppswap / torch "
        "| ppswap+swap / torch |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cpu, main = row["cpu_median_s"], row["cpu_main_median_s"]
        cells = [f"{1e3 * cpu[c]:.1f} ({1e3 * main[c]:.1f})" for c in CONTENDERS]
        lines.append(
            f"| {row['schedule']} pp{report['pp']} m{model['micro']} | {' | '.join(cells)} | "
            f"{row['ppswap/torch cpu']:.2f}x | {row['ppswap+swap/torch cpu']:.2f}x |"
        )
    lines += [
        "",
        "Where ppswap's step goes: the compute threads' time by job kind (backward with "
        "the chunk's release), the copy threads' busy time and the compute threads' time "
        "blocked for a copy not done at its SWAP_WAIT_* (exposed), wall time on each "
        "thread as the runtime times it (`RankStats.compute_job_s`, `copy_busy_s`, "
        "`exposed_copy_wait_s`), summed over the ranks, median over rounds, ms; swap's "
        "bookkeeping is in forward (capture), backward (unpack, release) and the swap "
        "steps:",
        "",
        "| schedule | contender | forward | backward | swap prepare | swap finish | copy busy "
        "| exposed wait |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for contender, parts in row["thread_median_s"].items():
            times_ms = " | ".join(f"{1e3 * parts[p]:.1f}" for p in THREAD_PARTS)
            lines.append(f"| {row['schedule']} | {contender} | {times_ms} |")
    lines += [
        "",
        "Peak saved-activation bytes per rank, counted the same way for both (distinct "
        "storages held for backward, parameters excluded): torch by saved-tensor hooks, "
        "ppswap by `RankStats.peak_saved_bytes` (with swap: not offloaded); predicted: "
        "the planner's peak chunks times ppswap's measured bytes per chunk:",
        "",
        "| schedule | rank | torch MiB | ppswap MiB | ppswap+swap MiB | measured cut vs torch "
        "| predicted chunks (no swap -> swap) | predicted swap MiB | predicted cut | "
        "swap offloaded MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for rank in result["ranks"]:
            swap = _mib(rank["swap_peak"])
            if rank["swap_peak_min"] != rank["swap_peak"]:
                swap = f"{_mib(rank['swap_peak_min'])}-{swap}"
            lines.append(
                f"| {result['schedule']} | {rank['rank']} | {_mib(rank['torch_peak'])} | "
                f"{_mib(rank['ppswap_peak'])} | {swap} | "
                f"{_cut(rank['torch_peak'], rank['swap_peak'])} | "
                f"{rank['chunks_no_swap']} -> {rank['chunks_swap']} | "
                f"{_mib(rank['predicted_swap'])} | "
                f"{_cut(rank['chunks_no_swap'], rank['chunks_swap'])} | "
                f"{_mib(rank['offloaded'])} |"
            )
    checks = [
        f"{r['schedule']}: losses {'bit-identical' if r['losses_bit_identical'] else 'equal'}"
        if r["losses_equal"]
        else f"{r['schedule']}: losses DIFFER"
        for r in results
    ]
    swap_same = all(r["swap_bit_identical"] for r in results)
    lines += [
        "",
        f"Losses, ppswap against torch (rtol {LOSS_RTOL:g}): {'; '.join(checks)}. "
        f"Swap on = off bit for bit: {'yes' if swap_same else 'NO'}.",
        "",
        headline(report),
    ]
    return "\n".join(lines)


def headline(report: dict[str, Any]) -> str:
    """One line: the ratios per schedule, the line ``run_all``'s headline quotes."""
    parts = [
        f"{row['schedule']} {row['ppswap/torch']:.2f}x / {row['ppswap+swap/torch']:.2f}x "
        f"(CPU time {row['ppswap/torch cpu']:.2f}x / {row['ppswap+swap/torch cpu']:.2f}x)"
        for row in report["summary"]
    ]
    return (
        f"Against torch.distributed.pipelining (pp{report['pp']}, gloo, "
        f"{report['model_name']} model: width {report['model']['dim']}, "
        f"{report['model'].get('dtype', 'float32')}, "
        f"swap_policy {report.get('swap_policy', 'gap')}, median step time, "
        f"ppswap without / with swap over torch; targets 1.10x / 1.15x; load average "
        f"{report['load_before'].split(',')[0]} on {_cores(report)}): "
        f"{', '.join(parts)}."
    )


def _cores(report: dict[str, Any]) -> str:
    """The cores the job ran on ("2 logical cores"), and ``--cores`` where it was given."""
    cores = report["cores"]
    text = f"{cores} logical core{'' if cores == 1 else 's'}"
    return f"{text} (--cores {cores})" if report.get("cores_given") else text
