"""The demos' closing report: losses swap off and on, measured peaks against the plan, the
step times (``ppswap demo``; the FSDP demo shares the step-time line)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ppswap.results import RunResult

__all__ = ["REPORT_LEGEND", "DemoReport", "format_report", "step_time_line"]


@dataclass(frozen=True, slots=True)
class DemoReport:
    losses_no_swap: list[float]
    losses_swap: list[float]
    last_no_swap: RunResult
    last_swap: RunResult
    predicted: list[dict[str, int]]
    step_times_no_swap: list[float]
    step_times_swap: list[float]


def step_time_line(no_swap: list[float], swap: list[float]) -> str:
    """The report's step-time line: the median over the steps after the first (which
    warms up), swap off and on, and their ratio; one step is reported as it is."""
    if len(no_swap) > 1 and len(swap) > 1:
        later = "step 2" if len(no_swap) == 2 else f"median of steps 2-{len(no_swap)}"
        which = f"{later}; step 1 warms up"
        off, on = statistics.median(no_swap[1:]), statistics.median(swap[1:])
    else:
        which = "one step, warm-up included"
        off, on = no_swap[-1], swap[-1]
    ratio = f" ({on / off:.2f}x)" if off > 0 else ""
    return f"step time ({which}): swap off {off:.2f}s, swap on {on:.2f}s{ratio}"


REPORT_LEGEND: tuple[str, ...] = (
    "columns (from the last step of each pass):",
    "  rank                  pipeline rank (stage s runs on rank s % pp)",
    "  peak saved off/on     measured peak of the bytes autograd keeps for backward, swap off / on",
    "  cut                   how much swap lowers that peak: 1 - on / off",
    "  chunks off/on (plan)  planned peak of resident chunks (a chunk: what one forward saves)",
    "  predicted on          planned peak with swap in bytes (those chunks x measured sizes)",
    "  exposed wait          time compute waited on swap copies (copy time not hidden by compute)",
)
"""The lines under the report table that say what each column means."""


def format_report(report: DemoReport) -> str:
    """The closing table: per rank, measured against predicted."""
    lines = []
    same = report.losses_no_swap == report.losses_swap
    lines.append(f"losses swap off: {' '.join(f'{v:.5f}' for v in report.losses_no_swap)}")
    lines.append(f"losses swap on:  {' '.join(f'{v:.5f}' for v in report.losses_swap)}")
    lines.append(f"bit-identical: {'yes' if same else 'NO'}")
    lines.append("")
    header = (
        f"{'rank':>4} | {'peak saved off':>14} | {'peak saved on':>13} | {'cut':>6} | "
        f"{'chunks off/on (plan)':>20} | {'predicted on':>12} | {'exposed wait':>12}"
    )
    lines.append(header)
    lines.append("-" * len(header))
    for off, on, plan in zip(
        report.last_no_swap.ranks, report.last_swap.ranks, report.predicted, strict=True
    ):
        chunks_off = plan["peak_chunks_no_swap"]
        chunks_on = plan["peak_chunks_swap"]
        # The memory model in bytes: a chunk's offloadable bytes come back at most
        # `chunks_on` at a time; what alias protection pins stays for every live chunk.
        per_chunk = off.peak_saved_bytes / chunks_off if chunks_off else 0.0
        offloadable = on.offloaded_bytes / plan["eligible"] if plan["eligible"] else 0.0
        predicted = chunks_on * offloadable + chunks_off * (per_chunk - offloadable)
        cut = 1 - on.peak_saved_bytes / off.peak_saved_bytes if off.peak_saved_bytes else 0.0
        lines.append(
            f"{off.rank:>4} | {off.peak_saved_bytes:>14,} | {on.peak_saved_bytes:>13,} | "
            f"{cut:>6.1%} | {chunks_off:>9} / {chunks_on:<8} | {predicted:>12,.0f} | "
            f"{on.exposed_copy_wait_s * 1e3:>9.1f} ms"
        )
    lines.append("")
    lines += REPORT_LEGEND
    lines.append("")
    lines.append(step_time_line(report.step_times_no_swap, report.step_times_swap))
    return "\n".join(lines)
